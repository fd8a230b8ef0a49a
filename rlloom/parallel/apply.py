"""Apply a whole `Layout` to a plain model; optimizers, full and sharded state dicts for it.

    mesh = build_mesh(layout)                  # after init_process_group
    model = parallelize(model, layout, mesh)   # a plain model, same weights on every rank
    optim = make_optimizer(model, layout, mesh, lr=1e-5)
    ...
    save_sharded(model, optim, "ckpt/step_100")  # every rank; any layout can load it
    state = full_state_dict(model)               # rank 0: plain tensors for HF export

The order is fixed: context parallel first (it swaps the backbone for a wrapper over
sequence shards of `cp`, holding the same modules), then expert parallel (each MoE block
keeps its share of the experts, spread over the dp ranks), then tensor parallel (it
replaces Linear/RMSNorm weights, the kept experts' too, by DTensors sharded over `tp`, and
hooks the backbone, the wrapper under cp, so its output comes back whole: within a cp
shard, TP's sequence-parallel norms split the shard again), then activation checkpointing
(it wraps whole layers, whatever is inside), then data parallel (FSDP2 shards the
already-TP DTensors again over `dp` and groups each checkpointed layer; routed experts are
left to their owners).
"""
from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from rlloom.models.hf_io import replace_dir
from rlloom.parallel.checkpointing import apply_activation_checkpointing
from rlloom.parallel.context_parallel import apply_context_parallel
from rlloom.parallel.data_parallel import Zero1AdamW, apply_data_parallel, local_tensor
from rlloom.parallel.expert_parallel import (
    ExpertGroups,
    apply_expert_parallel,
    is_expert_parameter,
    scale_expert_grads,
)
from rlloom.parallel.mesh import LayoutError, build_mesh, validate_layout
from rlloom.parallel.pipeline import (
    PipelinedModel,
    cp_ranks,
    first_and_last_stages,
    tp_ranks,
)
from rlloom.parallel.tensor_parallel import apply_tensor_parallel, backbone_of
from rlloom.plan import Layout


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh | None = None, *,
                mixed_precision: bool | None = None, experts: ExpertGroups | None = None
                ) -> nn.Module:
    """Apply `layout` to the plain `model` in place (CP -> EP -> TP -> checkpointing ->
    DP/ZeRO).

    The model must hold the same weights on every rank, on the mesh's device. `mesh`
    defaults to `build_mesh(layout)` over the whole world; pass one (with the dimension
    names of `mesh.MESH_DIMS`) to use a subset of ranks, e.g. a role's device group. A
    1-process layout needs none. Returns `model` (the same object: its attributes, `config`
    and methods stay reachable). Call the model itself (or a method of
    `data_parallel.FORWARD_METHODS`) before its submodules, or DP's hooks do not run.
    `mixed_precision=None` uses bf16 compute where the device supports it (see
    `data_parallel.mixed_precision_policy`); it only applies when dp > 1. `experts`: the
    expert-parallel groups when ep > 1 (made from the mesh when not given); with ep < dp,
    call `experts.reduce(model)` after each backward.
    """
    if layout.pp > 1:
        raise LayoutError(f"pp={layout.pp}: parallelize applies one model on every rank; "
                          "pipeline stages are `pipeline.PipelinedModel` (set pp=1 here)")
    if layout.world_size > 1 and mesh is None:
        mesh = build_mesh(layout)
    # A 1-process layout applies to this process's own copy, whatever else is running.
    validate_layout(layout, backbone_of(model).config, mesh.size() if mesh is not None else 1)
    if layout.cp > 1:
        apply_context_parallel(model, mesh["cp"].get_group())
    if layout.ep > 1:
        apply_expert_parallel(model, (experts or ExpertGroups.of(mesh, layout.ep)).ep)
    if layout.tp > 1:   # after EP: it splits the features of the experts each rank holds
        apply_tensor_parallel(model, mesh["tp"])
    expert_params = _expert_grads(model, layout)
    if layout.activation_checkpointing:
        apply_activation_checkpointing(model)
    if layout.dp > 1:
        apply_data_parallel(model, mesh["dp"], layout.zero, mixed_precision,
                            ignored=expert_params or None, offload=layout.offload)
    return model


def parallelize_pipeline(model: nn.Module, layout: Layout, mesh: DeviceMesh, *,
                         experts: ExpertGroups | None = None, trains: bool = True,
                         mixed_precision: bool = False) -> PipelinedModel:
    """This rank's pipeline stage of the plain `model` at `layout` (pp > 1): EP -> the stage
    (TP and CP inside it) -> checkpointing -> DP over the stage's dp replicas. A
    model that does not train (`trains=False`) is wrapped by DP only at ZeRO-3, to shard it;
    whole copies need no wrapper. `mixed_precision`: DP gathers bf16 weights, as `parallelize`
    does (the pipeline's schedule keeps a stage's weights gathered across its pieces: fp32
    copies would be twice the bytes, beside autocast's bf16 ones)."""
    validate_layout(layout, backbone_of(model).config, mesh.size())
    if layout.ep > 1:
        apply_expert_parallel(model, (experts or ExpertGroups.of(mesh, layout.ep)).ep)
    pipe = PipelinedModel(model, mesh["pp"].get_group(), tied_group=first_and_last_stages(mesh),
                          tp_mesh=tp_ranks(mesh), cp_group=cp_ranks(mesh))
    if layout.activation_checkpointing:  # after the stage's TP, which names the layers' parts
        apply_activation_checkpointing(pipe.module, pipe.module.model.layers)
    expert_params = _expert_grads(pipe.module, layout)
    if layout.dp > 1 and (trains or layout.zero == 3):
        apply_data_parallel(pipe.module, mesh["dp"], layout.zero,
                            mixed_precision=mixed_precision and trains,
                            layers=pipe.module.model.layers.values(),
                            ignored=expert_params or None, offload=layout.offload)
    return pipe


def _expert_grads(model: nn.Module, layout: Layout) -> set[nn.Parameter]:
    """The routed experts' parameters (left out of data parallelism: they differ between the
    dp ranks), their gradients scaled by 1/dp as computed: each rank's loss is normalised
    so that dp's average of the replicas' gradients is the batch's, and an expert's owner
    sums the tokens of its expert group (and `ExpertGroups.reduce` the groups') instead of
    averaging them."""
    if layout.ep == 1:
        return set()
    scale_expert_grads(model, 1 / layout.dp)
    return {p for n, p in model.named_parameters() if is_expert_parameter(n)}


def make_optimizer(model: nn.Module, layout: Layout, mesh: DeviceMesh | None, lr: float,
                   **adamw: Any) -> torch.optim.Optimizer:
    """AdamW over the (parallelised) model's parameters, with ZeRO-1 state sharding.

    At zero=1 this is `Zero1AdamW` over the dp group: each rank keeps Adam moments only for
    the parameters it owns, steps them, and broadcasts them to the other dp ranks. At
    zero=2/3 FSDP already hands the optimizer 1/dp shards, so a plain AdamW is sharded.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if layout.zero == 1 and layout.dp > 1:
        # routed experts differ between the dp ranks: each steps its own
        experts = [p for n, p in named if is_expert_parameter(n)] if layout.ep > 1 else []
        return Zero1AdamW(params, mesh["dp"].get_group(), own=experts, lr=lr, **adamw)
    return torch.optim.AdamW(params, lr=lr, **adamw)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot of plain, unsharded CPU tensors under the plain model's names, on rank 0
    ({} on other ranks).

    A collective under torch.distributed: every rank must call it. The keys match
    `CausalLM(cfg).state_dict()`, so the result saves as a Hugging Face checkpoint. The
    tensors never share storage with the model, so training may go on while they are written.
    """
    if not dist.is_initialized():
        state = model.state_dict()
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    # Unsharded CPU parameters come back as the parameters themselves (replicated DTensors
    # gather nothing, CPU offload copies nothing); copy those, keep the fresh ones.
    live = {local_tensor(t).untyped_storage().data_ptr()
            for t in [*model.parameters(), *model.buffers()]}
    return {k: v.detach().clone() if v.untyped_storage().data_ptr() in live else v
            for k, v in state.items()}


# Optimizer state keyed by parameter name, hyperparameters too: unflattened, a param group is
# keyed by its index, so ranks that hold different parameters (pipeline stages, expert shards)
# would write one key and load each other's parameter lists.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optim is not None:
        state["optim"] = get_optimizer_state_dict(model, optim, options=_OPTIM)
    return state


def save_sharded(model: nn.Module, optim: torch.optim.Optimizer | None,
                 path: str | os.PathLike) -> None:
    """Every rank writes its own shards of model (and optimizer) state into directory `path`.

    Collective. Written into a temporary sibling directory and renamed when all ranks are
    done, so `path` is either the previous checkpoint or the complete new one. Any layout
    (or a single process) can `load_sharded` it: names are the plain model's, and DCP
    reshards on load.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    with _single_process_is_intended():
        dcp.save(_state(model, optim), checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    _barrier()
    if rank0:
        replace_dir(tmp, path)
    _barrier()


def load_sharded(model: nn.Module, optim: torch.optim.Optimizer | None,
                 path: str | os.PathLike) -> None:
    """Load a `save_sharded` checkpoint into `model` (and `optim`) at this model's layout.

    Collective. Each rank reads the slices of each tensor its own shards cover, so the saving
    and loading layouts may differ (e.g. saved FSDP over 2 ranks, loaded TP over 2 or in
    one process). The optimizer is optional both ways: a weights-only load ignores saved
    optimizer state.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(f"no sharded checkpoint at {path}")
    state = _state(model, optim)
    with _single_process_is_intended():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    if optim is not None:
        set_optimizer_state_dict(model, optim, state["optim"], options=_OPTIM)


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # DCP warns that it "assumes" a single process even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
