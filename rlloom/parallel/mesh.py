"""Device meshes from a `Layout`, and the checks that a layout fits a model and a world."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlloom.models.config import ModelConfig
from rlloom.plan import Layout, unsplit_degrees

# Outermost to innermost. Ranks that differ only in the innermost dimension are adjacent
# (rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i), so the chattiest group, tensor
# parallel (collectives in every layer), stays inside a node; pipeline stages, which only
# pass activations between neighbours, span the slowest links. Expert parallelism has no
# dimension of its own: experts are spread over groups of dp ranks (at each cp, tp and pp
# coordinate), as the Layout's world_size (which leaves ep out) already says.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")


class LayoutError(ValueError):
    """A layout that cannot run on this model or world; the message says how to fix it."""


def layout_problems(layout: Layout, cfg: ModelConfig, world_size: int) -> list[str]:
    """Every reason `layout` cannot run `cfg` on `world_size` processes (empty when it can)."""
    problems = []
    degrees = "x".join(f"{d}={getattr(layout, d)}" for d in MESH_DIMS)
    if layout.world_size != world_size:
        problems.append(
            f"the degrees {degrees} multiply to {layout.world_size} processes but the world "
            f"has {world_size}; change the degrees so that pp*dp*cp*tp = {world_size}")
    tp = layout.tp
    experts = getattr(cfg, "n_experts", 0) or 0
    split = (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
             ("intermediate_size", cfg.intermediate_size))
    if experts:   # tensor parallelism splits every expert's features too
        split += (("moe_intermediate_size", cfg.moe_intermediate_size),)
    for what, n in split:
        if n % tp:
            fits = [d for d in range(1, n + 1) if n % d == 0]
            problems.append(f"tp={tp} does not divide the model's {what}={n}, which tensor "
                            f"parallelism splits evenly; use tp in {fits}")
    if cfg.num_layers % layout.pp:
        problems.append(f"pp={layout.pp} does not divide num_layers={cfg.num_layers}; use a pp "
                        "that divides the number of layers so every stage holds the same count")
    if layout.ep > 1:
        if not experts:
            problems.append(f"ep={layout.ep} but the model has no experts (dense {cfg.family}); "
                            "set ep=1")
        elif experts % layout.ep:
            problems.append(f"ep={layout.ep} does not divide n_experts={experts}; use an ep "
                            "that divides the number of experts")
        if layout.dp % layout.ep:
            problems.append(f"ep={layout.ep} must divide dp={layout.dp}, the ranks experts "
                            "are spread over; change ep or dp")
    for dim, why in unsplit_degrees(getattr(cfg, "latent", False),
                                    getattr(cfg, "n_shared_experts", 0) > 0).items():
        if getattr(layout, dim) > 1:
            problems.append(f"{dim}={getattr(layout, dim)}: {why}; set {dim}=1 (dp with ZeRO, "
                            "ep, cp and pp split this model)")
    if layout.zero and layout.dp == 1:
        problems.append(f"zero={layout.zero} shards over data-parallel ranks but dp=1; set "
                        "zero=0 or dp>1")
    return problems


def validate_layout(layout: Layout, cfg: ModelConfig, world_size: int) -> None:
    """Raise `LayoutError` listing every problem (and its fix) of running `cfg` at `layout`."""
    problems = layout_problems(layout, cfg, world_size)
    if problems:
        raise LayoutError("layout " + layout_summary(layout) + " cannot run:\n  - "
                          + "\n  - ".join(problems))


def layout_summary(layout: Layout) -> str:
    return (" ".join(f"{d}={getattr(layout, d)}" for d in MESH_DIMS)
            + f" ep={layout.ep} zero={layout.zero}"
            + (" ac" if layout.activation_checkpointing else "")
            + (" offload" if layout.offload else ""))


def default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(layout: Layout, device_type: str | None = None) -> DeviceMesh:
    """A mesh with one named dimension per entry of `MESH_DIMS`, in that order.

    Degree-1 dimensions are kept so `mesh["tp"]` always exists. Needs an initialised
    process group whose world size is `layout.world_size`.
    """
    if not dist.is_initialized():
        raise LayoutError("build_mesh needs torch.distributed initialised (init_process_group"
                          " with gloo on CPU, nccl on GPU); a 1-process layout needs no mesh")
    world = dist.get_world_size()
    if layout.world_size != world:
        raise LayoutError(f"layout {layout_summary(layout)} needs {layout.world_size} processes"
                          f" but the world has {world}; launch {layout.world_size} processes, "
                          "change the degrees, or pass parallelize a mesh of the ranks to use")
    shape = tuple(getattr(layout, d) for d in MESH_DIMS)
    return init_device_mesh(device_type or default_device_type(), shape, mesh_dim_names=MESH_DIMS)
