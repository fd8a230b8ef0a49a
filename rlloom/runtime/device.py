"""`train.device` resolved against this machine: where a process keeps its models and every
tensor that meets their outputs. Host-side work (decoding, verifiers, metrics) stays on the CPU.
"""
from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from rlloom.config import ConfigError
from rlloom.perf.model.memory import USABLE


def _no_cuda(requested: str) -> ConfigError:
    return ConfigError(f"train.device={requested} but torch.cuda.is_available() is False (torch "
                       f"{torch.__version__}): install a CUDA build of torch or set "
                       "train.device=cpu")


def resolve_device(requested: str) -> torch.device:
    """The device of a single-process run: `auto` is cuda when torch sees a GPU, else cpu; a
    bare `cuda` becomes the current CUDA device, so devices compare equal to tensors'."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise _no_cuda(requested)
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ConfigError(f"train.device={requested} but this machine has {count} CUDA "
                          f"device(s), cuda:0 to cuda:{count - 1}; pick one of those")
    return torch.device("cuda", index)


def torchrun_device(requested: str) -> torch.device:
    """The device of this `torchrun` process: cuda:LOCAL_RANK, or the CPU when `train.device`
    is cpu or `auto` finds no GPU (the process group then uses gloo, NCCL otherwise)."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if requested not in ("auto", "cuda"):
        raise ConfigError(f"train.device={requested}: under torchrun each process uses "
                          "cuda:LOCAL_RANK; set train.device=cuda (or auto)")
    if not torch.cuda.is_available():
        raise _no_cuda(requested)
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        raise ConfigError(f"torchrun process LOCAL_RANK={local} has no GPU: this machine has "
                          f"{count}; start at most {count} processes per node "
                          "(--nproc_per_node) or set train.device=cpu")
    return torch.device("cuda", local)


def model_device(model: nn.Module) -> torch.device:
    """Where `model`'s parameters live (for a sharded model, this process's shards)."""
    return next(model.parameters()).device


def compute_dtype(requested: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `train.compute_dtype` on `device` (None: the parameters')."""
    if requested == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else None
    return torch.bfloat16 if requested == "bfloat16" else None


def frozen_dtype(requested: str, params: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of a model that never trains (the reference): the compute dtype, which every
    matmul reads it in anyway; its weights in fp32 would take twice the bytes for nothing."""
    return compute_dtype(requested, device) or params


def compute_precision(requested: str, device: torch.device) -> AbstractContextManager:
    """Autocast to `compute_dtype` for the block (a no-op when it is the parameters'): the
    weights and the optimizer state stay in their own dtype, the masters of mixed
    precision."""
    dtype = compute_dtype(requested, device)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def kv_budget_bytes(device: torch.device) -> int:
    """Bytes a generation's KV cache may take on `device`: on a GPU the usable memory
    (`perf.model.memory.USABLE`, as the cost model sizes it) less what is allocated now (the model
    state); 0, no cap, on a CPU, whose KV lives in host memory."""
    if device.type != "cuda":
        return 0
    usable = torch.cuda.get_device_properties(device).total_memory * USABLE
    return max(1, int(usable - torch.cuda.memory_allocated(device)))
