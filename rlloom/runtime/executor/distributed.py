"""A `torchrun` world as one colocated group (`ranks.RankGroup`, whose docstring gives the
data flow): what torchrun runs, the actor's layouts in it, and sharded checkpoints of a
group's trained models (written by every rank of the group, loadable at any layout)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlloom.config import ConfigError, RunConfig
from rlloom.models.hf_io import replace_dir
from rlloom.parallel.apply import load_sharded, save_sharded
from rlloom.plan import Layout
from rlloom.runtime.checkpoint import checkpoint_dirs
from rlloom.runtime.device import torchrun_device
from rlloom.runtime.executor.ranks import RankGroup, needs_generation_copy
from rlloom.runtime.executor.ray_plan import world_size


def distributed_problems(cfg: RunConfig, world: int) -> list[str]:
    """Why this plan cannot run in a `torchrun` world of `world` processes (empty when it can).
    Placement and schedule across roles are the Ray runtime's; here every role shares the
    world, the actor with its training layout and optionally a "rollout" generation layout."""
    plan, problems = cfg.plan, []
    if plan.placement != "colocated" or plan.schedule != "sync":
        problems.append(f"plan.placement={plan.placement}, plan.schedule={plan.schedule}: "
                        "torchrun runs colocated/sync plans (use the Ray runtime for others)")
    for role in ("actor", "rollout"):
        layout = plan.layouts.get(role)
        if layout is None and role == "rollout":
            continue
        layout = layout or Layout()
        if layout.world_size != world:
            problems.append(f"plan.layouts.{role} uses {layout.world_size} processes but "
                            f"torchrun started {world}; make dp x tp x pp x cp = {world}")
        for dim in ("pp", "cp", "ep"):
            if getattr(layout, dim) > 1:
                problems.append(f"plan.layouts.{role}.{dim}={getattr(layout, dim)}: the trainer "
                                "applies dp (zero 0-3) and tp; set it to 1")
    for role in ("reference", "critic", "reward"):
        if role in plan.layouts:
            problems.append(f"plan.layouts.{role}: under torchrun the {role} follows the actor's "
                            "layout (forward-only roles keep zero 0); remove the entry")
    if cfg.rollout.stop and world > 1:
        problems.append("rollout.stop needs the generation engine's fast path, which runs only "
                        "unsharded models; remove rollout.stop or run in one process")
    return problems


def join_torchrun(requested: str) -> RankGroup:
    """This process's place in the world torchrun started, on its device for
    `train.device=requested` (cuda:LOCAL_RANK under NCCL, else the CPU with gloo)."""
    return RankGroup.join(torchrun_device(requested), world=world_size())


@dataclass
class TorchrunLayouts:
    """The actor's layouts in a torchrun world: it trains in `train`, and generates in `gen`
    on its own copy when `gen_copy`. Generation runs on a copy (TP only, never a DP wrapper)
    when the plan gives a "rollout" layout or the actor trains data-parallel: data-parallel
    replicas generate different prompts for different numbers of steps, so their forward
    passes must not need each other (ZeRO-3 gathers would deadlock). Weights are resharded
    into it before each generation."""
    train: Layout
    gen: Layout
    gen_copy: bool

    @classmethod
    def of(cls, cfg: RunConfig) -> "TorchrunLayouts":
        problems = distributed_problems(cfg, world_size())
        if problems:
            raise ConfigError("this plan cannot run under torchrun: " + "; ".join(problems))
        train = cfg.plan.layout("actor")
        gen = cfg.plan.layouts.get("rollout", train)
        return cls(train, gen, needs_generation_copy(train, gen))


def save_sharded_checkpoint(ranks: RankGroup, run_dir: Path, step: int, state: dict[str, Any],
                            parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
                            keep: int) -> None:
    """checkpoints/step_NNNNNN with each model's DCP shards under its name and the loop state
    (step, RNG, data position) in state.pt; renamed into place only when complete."""
    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp_step_{step:06d}", root / f"step_{step:06d}"
    if ranks.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    ranks.barrier()
    for name, (model, optim) in parts.items():
        save_sharded(model, optim, tmp / name)
    if ranks.main:
        torch.save(state, tmp / "state.pt")
        replace_dir(tmp, final)
        for old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old)
    ranks.barrier()


def load_sharded_checkpoint(run_dir: Path,
                            parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]]
                            ) -> dict[str, Any] | None:
    """The latest checkpoint's loop state, after loading every model's shards at this run's
    layout (which may differ from the one that saved them)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    latest = dirs[-1]
    if not (latest / "actor").is_dir():
        raise ConfigError(f"{latest} was written by a single-process run; resume it without "
                          "torchrun (sharded and single-process checkpoints do not mix yet)")
    for name, (model, optim) in parts.items():
        load_sharded(model, optim, latest / name)
    return torch.load(latest / "state.pt", map_location="cpu", weights_only=False)
