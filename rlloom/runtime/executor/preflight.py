"""Every check a run makes before any work, for the runtime that will run it: one function,
which `rlloom train` and `--dry-run` both call, so the two cannot disagree."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from rlloom.algos.contracts import algo_problems
from rlloom.config import ConfigError, RunConfig
from rlloom.plan import Layout, runnable_problems
from rlloom.runtime.executor.adapt import adapt_hardware
from rlloom.runtime.executor.groups import group_specs, loop_problems, run_models
from rlloom.runtime.executor.interface import RunOptions

Runtime = Literal["process", "torchrun", "ray"]


def torchrun_problems(cfg: RunConfig, world: int) -> list[str]:
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


def ray_problems(cfg: RunConfig, opts: RunOptions) -> list[str]:
    """Why the Ray runtime cannot run this configuration (empty when it can)."""
    problems = runnable_problems(cfg.plan, run_models(cfg)) + loop_problems(cfg, opts)
    if cfg.train.device.startswith("cuda:"):
        problems.append(f"train.device={cfg.train.device}: on Ray every rank gets a GPU of its "
                        "own; set train.device=cuda (or auto)")
    if opts.worker_timeout_s <= 0 or opts.max_restarts < 0:
        problems.append("--worker-timeout must be > 0 and --max-restarts >= 0")
    names = {g.name for g in group_specs(cfg)}
    unknown = set(opts.group_cpus) - names
    if unknown:
        problems.append(f"CPUs given for groups {sorted(unknown)}; this plan's groups are "
                        f"{', '.join(sorted(names))}")
    if any(c <= 0 for c in opts.group_cpus.values()):
        problems.append("group CPUs must be > 0")
    return problems




def _checks(cfg: RunConfig, runtime: Runtime, opts: RunOptions, world: int
            ) -> Iterator[tuple[str, list[str], str]]:
    """(what cannot run, its problems, how to run it instead), in the order they are told."""
    if runtime == "ray":  # the plan's groups and the step loop over them
        yield "the Ray runtime cannot run this configuration", ray_problems(cfg, opts), ""
    else:
        if runtime == "torchrun":
            yield (f"this plan cannot run under torchrun with {world} processes",
                   torchrun_problems(cfg, world), "")
        else:
            yield ("the single-process runtime cannot run this plan",
                   cfg.plan.single_process_problems(), " (launch it with torchrun "
                   "--nproc_per_node N -m rlloom train, or use the Ray runtime)")
        yield "the step loop cannot run this plan", loop_problems(cfg, opts), ""
    yield "this algorithm cannot run", algo_problems(cfg), ""
    yield "plan.adapt cannot run here", adapt_problems(cfg, runtime), ""


def adapt_problems(cfg: RunConfig, runtime: Runtime) -> list[str]:
    """Why `plan.adapt` cannot run (empty when it can, or is off): its hardware file, and a
    switch with no Ray groups to rebuild."""
    adapt = cfg.plan.adapt
    if not adapt.every:
        return []
    problems = []
    try:
        adapt_hardware(adapt.hardware)
    except ConfigError as e:
        problems.append(str(e))
    if not adapt.dry and runtime != "ray":
        problems.append("plan.adapt.dry=false switches plans by rebuilding Ray groups; this "
                        "run is one process or a torchrun world: run it on Ray (--ray), or "
                        "keep plan.adapt.dry=true")
    return problems


def preflight(cfg: RunConfig, runtime: Runtime, opts: RunOptions | None = None,
              world: int = 1) -> None:
    """Refuse, naming every problem of the first kind found, what `runtime` (one process, a
    torchrun world of `world` processes, or Ray) cannot execute."""
    for what, problems, instead in _checks(cfg, runtime, opts or RunOptions(), world):
        if problems:
            raise ConfigError(f"{what}: " + "; ".join(problems) + instead)
