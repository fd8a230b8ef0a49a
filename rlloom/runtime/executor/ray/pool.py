"""Ranks kept alive from one group to the next in this driver process.

Starting a rank costs about 3 CPU-seconds before it does any work (Ray's worker, then torch,
transformers and torch.distributed imported), more than a small run's steps. A group that
ended cleanly is closed (its models, sandbox pool and process groups dropped, `GroupWorker.
close`) and its slots kept: a slot is a placement group and the actors in its bundles (one
rank on a one-node cluster, the whole group on several nodes, `cluster.place_groups`). The
next group asking for slots of the same size and bundle takes them and rebinds each rank to
its run (`GroupWorker.bind`).

Within a run (plan.adapt's switch) kept slots are always offered; across runs only when
`RLLOOM_KEEP_RAY_WORKERS=1` (a test suite, a notebook running many short runs), because
idle ranks hold their CPUs and GPUs until the next run takes or evicts them. A rank that
failed, or a run that stopped on an error, is never kept: a rank may still be inside a
collective. What a run cannot use is evicted, oldest first, before its own placement groups
are made when the cluster lacks the room, so kept ranks never hold capacity a run needs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

KEEP_ACROSS_RUNS = "RLLOOM_KEEP_RAY_WORKERS"


@dataclass
class Slot:
    """A placement group and the actors in its bundles (rank order within the slot)."""
    pg: Any
    bundle: dict[str, float]  # each bundle's resources
    actors: list[Any]
    nodes: list[str]  # each actor's node id
    order: list[int]  # each actor's bundle index
    job: str = field(default="")  # the Ray session it was kept in (a ray.shutdown ends it)


_IDLE: list[Slot] = []


def keep_across_runs() -> bool:
    return os.environ.get(KEEP_ACROSS_RUNS, "") not in ("", "0")


def _job() -> str:
    import ray
    return ray.get_runtime_context().get_job_id()


def release(slot: Slot) -> None:
    """Kill a slot's ranks and free its placement group."""
    import ray
    for a in slot.actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass  # already gone
    ray.util.remove_placement_group(slot.pg)


def keep(slot: Slot) -> None:
    slot.job = _job()
    _IDLE.append(slot)


def _forget_other_sessions() -> None:
    """Drop slots kept in an earlier Ray session: they died with it (ray.shutdown)."""
    job = _job()
    _IDLE[:] = [s for s in _IDLE if s.job == job]


def take(size: int, bundle: dict[str, float]) -> Slot | None:
    """A kept slot of `size` ranks of `bundle` each, or None."""
    _forget_other_sessions()
    for i, slot in enumerate(_IDLE):
        if len(slot.actors) == size and slot.bundle == bundle:
            return _IDLE.pop(i)
    return None


def make_room(need: dict[str, float]) -> None:
    """Evict kept slots, oldest first, until the cluster's free resources plus theirs hold
    `need` (or none is left)."""
    import ray
    free = ray.available_resources()
    short = {k: v - free.get(k, 0.0) for k, v in need.items() if v > free.get(k, 0.0)}
    while short and _IDLE:
        slot = _IDLE.pop(0)
        release(slot)
        short = {k: v - slot.bundle.get(k, 0.0) * len(slot.actors) for k, v in short.items()}
        short = {k: v for k, v in short.items() if v > 0}


def evict() -> None:
    """Kill every kept slot (the end of a run that keeps nothing across runs, or whose Ray
    instance stops with it)."""
    _forget_other_sessions()
    while _IDLE:
        release(_IDLE.pop())
