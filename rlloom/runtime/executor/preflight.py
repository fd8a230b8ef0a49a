"""Every check a run makes before any work, for the runtime that will run it: one function,
which `rlloom train` and `--dry-run` both call, so the two cannot disagree."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from rlloom.algos.contracts import algo_problems
from rlloom.config import ConfigError, RunConfig
from rlloom.runtime.executor.distributed import distributed_problems
from rlloom.runtime.executor.interface import RunOptions
from rlloom.runtime.executor.ray_plan import loop_problems, ray_problems

Runtime = Literal["process", "torchrun", "ray"]


def _checks(cfg: RunConfig, runtime: Runtime, opts: RunOptions, world: int
            ) -> Iterator[tuple[str, list[str], str]]:
    """(what cannot run, its problems, how to run it instead), in the order they are told."""
    if runtime == "ray":  # the plan's groups and the step loop over them
        yield "the Ray runtime cannot run this configuration", ray_problems(cfg, opts), ""
    else:
        if runtime == "torchrun":
            yield (f"this plan cannot run under torchrun with {world} processes",
                   distributed_problems(cfg, world), "")
        else:
            yield ("the single-process runtime cannot run this plan",
                   cfg.plan.single_process_problems(), " (launch it with torchrun "
                   "--nproc_per_node N -m rlloom train, or use the Ray runtime)")
        yield "the step loop cannot run this plan", loop_problems(cfg, opts), ""
    yield "this algorithm cannot run", algo_problems(cfg), ""


def preflight(cfg: RunConfig, runtime: Runtime, opts: RunOptions | None = None,
              world: int = 1) -> None:
    """Refuse, naming every problem of the first kind found, what `runtime` (one process, a
    torchrun world of `world` processes, or Ray) cannot execute."""
    for what, problems, instead in _checks(cfg, runtime, opts or RunOptions(), world):
        if problems:
            raise ConfigError(f"{what}: " + "; ".join(problems) + instead)
