"""LoRA adapters on rlloom's own decoder: W x + (alpha / r) B A x on chosen projections.

An own small module rather than PEFT's: PEFT wraps each Linear in a LoraLayer whose base
weight moves to `base_layer.weight`, which changes the names rlloom's layouts, checkpoints
and generation engine address. `LoRALinear` *is* an nn.Linear (same `weight`, `bias`) with
two more parameters, so everything that reads the base weights keeps working, and the
adapters export in PEFT's format (`peft_state`, `peft_config`) for `peft` to load.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Hugging Face projection names of the decoder: attention and the dense MLP
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_KEYS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update; A starts as Kaiming-uniform, B as zeros, so the
    adapted layer computes exactly the base layer until B trains (PEFT's initialisation)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same parameters, not copies
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device,
                                               dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device,
                                               dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, what the layer computes without dropout."""
        if not self.enabled:
            return self.weight
        return self.weight + (self.lora_B @ self.lora_A) * self.scale


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float,
               targets: tuple[str, ...], seed: int) -> list[str]:
    """Replace every Linear whose name ends in one of `targets` by a LoRALinear, freeze every
    other parameter; the adapted module names. A's initialisation is drawn from `seed`, so
    every rank and every copy of the model starts with the same adapters."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    if not names:
        raise ValueError(f"model.lora.targets {list(targets)} match no linear layer; the "
                         f"decoder's are {', '.join(PROJECTIONS)}")
    model.requires_grad_(False)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    finally:
        torch.random.set_rng_state(state)
    return names


def lora_modules(model: Any) -> dict[str, LoRALinear]:
    """The LoRA layers of `model` by name; none for anything else (no model, a pipeline stage
    wrapper: LoRA runs without pipelining)."""
    if not isinstance(model, nn.Module):
        return {}
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def has_lora(model: Any) -> bool:
    return bool(lora_modules(model))


def is_adapter_key(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_KEYS


def trained_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a LoRA model's state dict that training changes, so what weight sync
    ships: the adapters, and any head beside the decoder (a shared actor-critic's values)."""
    return {k: v for k, v in state.items()
            if is_adapter_key(k) or not k.startswith(("model.", "lm_head."))}


@contextmanager
def adapters_disabled(model: Any) -> Iterator[Any]:
    """The base model, by switching its adapters off for the block: the reference policy of
    a LoRA run without a second copy of the weights."""
    modules = list(lora_modules(model).values())
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m in modules:
            m.enabled = True


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's whole weights) with each adapter folded into its base weight and
    the adapter entries dropped: a plain checkpoint of what the adapted model computes."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for name, m in lora_modules(model).items():
        a, b = state[f"{name}.lora_A"].float(), state[f"{name}.lora_B"].float()
        w = state[f"{name}.weight"]
        out[f"{name}.weight"] = (w.float() + (b @ a) * m.scale).to(w.dtype)
    return out


def peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (`base_model.model.<module>.lora_A.weight`)."""
    return {f"base_model.model.{k}.weight": v.contiguous()
            for k, v in state.items() if is_adapter_key(k)}


def peft_config(rank: int, alpha: float, dropout: float, targets: tuple[str, ...],
                base_model: str) -> dict[str, Any]:
    """adapter_config.json for these adapters, as PEFT writes it for a causal LM."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": dropout, "target_modules": sorted(targets), "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model, "use_rslora": False, "use_dora": False,
            "modules_to_save": None}
