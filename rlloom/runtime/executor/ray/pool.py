"""Ranks kept alive from one group to the next in this driver process.

Starting a rank costs about 3 CPU-seconds before it does any work (Ray's worker, then torch,
transformers and torch.distributed imported), more than a small run's steps. A group that
ended cleanly is closed (its models, sandbox pool and process groups dropped, `GroupWorker.
close`) and kept with its placement group; the next group asking for the same number of
ranks and the same bundle takes it and rebinds each rank to its run (`GroupWorker.bind`).

Within a run (plan.adapt's switch) kept ranks are always offered; across runs only when
`RLLOOM_KEEP_RAY_WORKERS=1` (a test suite, a notebook running many short runs), because
idle ranks hold their CPUs and GPUs until the next run takes or evicts them. A rank that
failed, or a run that stopped on an error, is never kept: a rank may still be inside a
collective. What a run cannot use is evicted before its own placement groups are made when
the cluster lacks the room, so kept ranks never hold capacity a run needs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

KEEP_ACROSS_RUNS = "RLLOOM_KEEP_RAY_WORKERS"


@dataclass
class Idle:
    """A closed group's ranks: its placement group, actors (rank order) and their node ids."""
    job: str  # the Ray session it lives in (a ray.shutdown ends it)
    ranks: int
    bundle: tuple[tuple[str, float], ...]
    pg: Any
    actors: list[Any]
    nodes: list[str]


_IDLE: list[Idle] = []


def keep_across_runs() -> bool:
    return os.environ.get(KEEP_ACROSS_RUNS, "") not in ("", "0")


def _job() -> str:
    import ray
    return ray.get_runtime_context().get_job_id()


def release(pg: Any, actors: list[Any]) -> None:
    """Kill a group's ranks and free its placement group."""
    import ray
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass  # already gone
    ray.util.remove_placement_group(pg)


def keep(ranks: int, bundle: dict[str, float], pg: Any, actors: list[Any],
         nodes: list[str]) -> None:
    _IDLE.append(Idle(_job(), ranks, tuple(sorted(bundle.items())), pg, actors, nodes))


def take(ranks: int, bundle: dict[str, float]) -> Idle | None:
    """A kept group of `ranks` ranks of `bundle` each, or None."""
    job, key = _job(), tuple(sorted(bundle.items()))
    _IDLE[:] = [i for i in _IDLE if i.job == job]  # the others died with their session
    for i, idle in enumerate(_IDLE):
        if idle.ranks == ranks and idle.bundle == key:
            return _IDLE.pop(i)
    return None


def make_room(need: dict[str, float]) -> None:
    """Evict kept groups, oldest first, until the cluster's free resources plus theirs hold
    `need` (or none is left)."""
    import ray
    free = ray.available_resources()
    short = {k: v - free.get(k, 0.0) for k, v in need.items() if v > free.get(k, 0.0)}
    while short and _IDLE:
        idle = _IDLE.pop(0)
        release(idle.pg, idle.actors)
        for k, v in idle.bundle:
            if k in short:
                short[k] -= v * idle.ranks
        short = {k: v for k, v in short.items() if v > 0}


def evict() -> None:
    """Kill every kept group (the end of a run that keeps nothing across runs)."""
    while _IDLE:
        idle = _IDLE.pop()
        release(idle.pg, idle.actors)
