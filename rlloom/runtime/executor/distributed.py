"""A `torchrun` world as one colocated group (`ranks.RankGroup`, whose docstring gives the
data flow): what torchrun runs and how a process joins it. The trainer runs the executor's
roles on it, so every layout the executor applies inside a group runs here too."""
from __future__ import annotations

from rlloom.config import RunConfig
from rlloom.plan import Layout, runnable_problems
from rlloom.runtime.device import torchrun_device
from rlloom.runtime.executor.ray_plan import run_models, world_size
from rlloom.runtime.ranks import RankGroup


def distributed_problems(cfg: RunConfig, world: int) -> list[str]:
    """Why this plan cannot run in a `torchrun` world of `world` processes (empty when it can).
    Placements of several groups are the Ray runtime's; here every model shares the world,
    each in its own layout over all of it, under any schedule of the step loop."""
    plan, problems = cfg.plan, []
    if plan.placement != "colocated":
        problems.append(f"plan.placement={plan.placement}: torchrun runs colocated plans, one "
                        "group over its world (use the Ray runtime for groups of their own)")
    for role in ("actor", "generation"):
        layout = plan.layouts.get(role)
        if layout is None and role == "generation":
            continue
        layout = layout or Layout()
        if layout.world_size != world:
            problems.append(f"plan.layouts.{role} uses {layout.world_size} processes but "
                            f"torchrun started {world}; make dp x tp x pp x cp = {world}")
    if not problems:
        problems += runnable_problems(plan, run_models(cfg))
    return problems


def join_torchrun(requested: str) -> RankGroup:
    """This process's place in the world torchrun started, on its device for
    `train.device=requested` (cuda:LOCAL_RANK under NCCL, else the CPU with gloo)."""
    return RankGroup.join(torchrun_device(requested), world=world_size())
