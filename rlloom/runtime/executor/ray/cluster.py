"""The cluster a Ray run uses, the groups of ranks on it, and how a failed worker is reported:
a local instance with its files under the run directory (or a joined cluster), and the
errors that name the group, stages and rank of a dead or silent worker."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlloom.config import ConfigError, RunConfig
from rlloom.data.prompts import DataError
from rlloom.models.hf_io import CheckpointError
from rlloom.parallel.mesh import LayoutError
from rlloom.plan import DeviceGroup, generation_layout, model_layout
from rlloom.runtime.executor.interface import (
    GroupCall,
    Method,
    RunOptions,
    WorkerFailure,
    routed,
)
from rlloom.runtime.executor.ray import pool
from rlloom.runtime.executor.ray.files import ship
from rlloom.user_code import UserCodeError

MAX_TEMP_DIR_CHARS = 42  # Ray's socket paths under its temp dir must stay below ~107 chars
USER_ERRORS = (ConfigError, DataError, CheckpointError, LayoutError, UserCodeError)


# -- cluster ---------------------------------------------------------------------------------

def ray_temp_dir(run_dir: Path) -> tuple[Path, str | None]:
    """<run_dir>/ray, or, when that path is too long for Ray's sockets, a short directory
    under /tmp that <run_dir>/ray links to (and a note saying so)."""
    temp = (run_dir / "ray").absolute()
    if len(str(temp)) <= MAX_TEMP_DIR_CHARS:
        return temp, None
    short = Path(tempfile.mkdtemp(prefix="rlloom-ray-", dir="/tmp"))
    if temp.is_symlink():  # a resumed run: point it at this session's files
        temp.unlink()
    if not temp.exists():
        temp.symlink_to(short, target_is_directory=True)
    return short, (f"Ray's files are in {short}: the run directory's path is too long for "
                   f"Ray's socket paths ({MAX_TEMP_DIR_CHARS} characters at most); {temp} "
                   "links there")


class Cluster:
    """A local Ray instance with its files under the run directory, or a connection to an
    existing cluster; leaves an instance that was already running in this process alone."""

    def __init__(self, opts: RunOptions, run_dir: Path, cpus: float) -> None:
        import ray
        self.owned = not ray.is_initialized()
        self.note: str | None = None
        if not self.owned:
            return
        if opts.address:
            try:
                ray.init(address=opts.address, log_to_driver=True)
            except (ConnectionError, RuntimeError) as e:
                raise ConfigError(
                    f"cannot join the Ray cluster at {opts.address}: {first_line(e)}. Check the "
                    "address `ray start --head` printed; a cluster with token authentication "
                    "(Ray >= 2.59 turns it on by default) also needs RAY_AUTH_MODE=token and its "
                    "token (RAY_AUTH_TOKEN or ~/.ray/auth_token) here; see docs/ray.md") from None
            return
        temp, self.note = ray_temp_dir(run_dir)
        ray.init(num_cpus=max(cpus, opts.num_cpus or 0, os.cpu_count() or 1),
                 _temp_dir=str(temp), include_dashboard=False, log_to_driver=True)

    def stop(self) -> None:
        import ray
        if self.owned and ray.is_initialized():
            ray.shutdown()


# -- faults ----------------------------------------------------------------------------------

@dataclass
class WorkerGroup:
    spec: DeviceGroup
    slots: list[pool.Slot]  # its placement groups and actors, in rank order
    nodes: list[str]  # rank -> its node's IP
    binding: list[Any]  # kept ranks' `bind` refs, waited on at start-up
    infos: list[dict[str, Any]] = field(default_factory=list)  # rank -> pid, host

    @property
    def actors(self) -> list[Any]:  # rank -> actor handle
        return [a for s in self.slots for a in s.actors]

    @property
    def name(self) -> str:
        return self.spec.name

    def call(self, method: Method, *args: Any, num_returns: int = 1, control: bool = False
             ) -> GroupCall:
        opts: dict[str, Any] = {"num_returns": num_returns}
        if control:
            opts["concurrency_group"] = "control"
        name, lead = routed(method)
        return GroupCall([getattr(a, name).options(**opts).remote(*lead, *args)
                          for a in self.actors])


def worker_device(requested: str, cluster_gpus: float) -> torch.device:
    """Every rank's device type: one GPU per rank where the cluster has GPUs (`auto`, `cuda`),
    else the CPU."""
    if requested == "cuda" and not cluster_gpus:
        raise ConfigError("train.device=cuda but the Ray cluster has no GPUs; set "
                          "train.device=cpu or auto, or join a cluster with GPUs (--ray-address)")
    return torch.device("cuda" if requested != "cpu" and cluster_gpus else "cpu")


def place_groups(cfg: RunConfig, opts: RunOptions, specs: list[DeviceGroup], model_path: Path,
                 run_dir: Path, device: torch.device, worker: Any) -> dict[str, WorkerGroup]:
    """Each group: its ranks in placement groups of one bundle per rank (one GPU each on GPU
    machines), one (not yet started) `worker` actor per bundle, the ranks that share a node
    numbered one after another (so a group's tensor-parallel ranks, innermost, share a node
    when a node holds a multiple of them); refused at once when the cluster cannot hold every
    rank. On several nodes a group is one placement group (packed together); on one node each
    rank is its own, so that a kept rank (`pool.py`) serves any later group. Kept ranks are
    rebound before fresh ones start. Nodes other than the driver's get the driver's inputs
    they lack (`files.ship`)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    gpu = device.type == "cuda"
    bundles = {g.name: {"CPU": opts.cpus(g.name), **({"GPU": 1.0} if gpu else {})}
               for g in specs}

    def resources(ranks: dict[str, int]) -> dict[str, float]:
        return {k: sum(bundles[name].get(k, 0.0) * n for name, n in ranks.items())
                for k in ("CPU", "GPU")}
    _wait_for_capacity(opts, specs, resources({g.name: g.ranks for g in specs}))
    per_rank = sum(1 for n in ray.nodes() if n["Alive"]) == 1
    size = {g.name: 1 if per_rank else g.ranks for g in specs}  # ranks per slot
    slots = {g.name: [s for _ in range(g.ranks // size[g.name])
                      if (s := pool.take(size[g.name], bundles[g.name])) is not None]
             for g in specs}
    missing = {g.name: g.ranks // size[g.name] - len(slots[g.name]) for g in specs}
    pool.make_room(resources({name: n * size[name] for name, n in missing.items()}))
    for spec in specs:
        slots[spec.name] += _new_slots(spec, bundles[spec.name], size[spec.name],
                                       missing[spec.name], opts)
    nodes = {name: [n for s in group for n in s.nodes] for name, group in slots.items()}
    ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    ips = {name: [ip.get(n, n) for n in ids] for name, ids in nodes.items()}
    for spec in specs:
        split = node_split_warning(cfg, spec, ips[spec.name])
        if split:
            print(split)
    shipped = ship(cfg, model_path, run_dir, nodes,
                   {g.name for g in specs if g.runs("training") and g.ranks > 1})
    groups = {}
    for spec in specs:
        threads = cfg.train.threads or max(1, round(opts.cpus(spec.name)))
        binding, rank = [], 0
        for slot in slots[spec.name]:
            new = not slot.actors
            for i, node in enumerate(slot.nodes):
                args = (cfg, str(model_path), spec, rank, threads,
                        "cuda:0" if gpu else "cpu")  # Ray shows each worker its own GPU only
                files = shipped.get(node)
                if new:
                    slot.actors.append(worker.options(
                        num_cpus=bundles[spec.name]["CPU"], num_gpus=1 if gpu else 0,
                        max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                            slot.pg, slot.order[i])).remote(*args, files=files))
                else:
                    binding.append(slot.actors[i].bind.remote(*args, files=files))
                rank += 1
        groups[spec.name] = WorkerGroup(spec, slots[spec.name], ips[spec.name], binding)
    return groups


def _wait_for_capacity(opts: RunOptions, specs: list[DeviceGroup], need: dict[str, float]
                       ) -> None:
    """Refuse at once a plan the cluster cannot hold; a joined cluster may grow (a lost node
    rejoining, an autoscaler): wait for it up to the start-up timeout."""
    import ray
    deadline = time.monotonic() + (opts.startup_timeout_s if opts.address else 0)
    said = False
    while True:
        have = ray.cluster_resources()
        short = {k: v for k, v in need.items() if v > have.get(k, 0)}
        if not short or time.monotonic() >= deadline:
            break
        if not said:
            print(f"waiting up to {opts.startup_timeout_s:g}s for the cluster to hold "
                  f"{', '.join(f'{v:g} {k}s' for k, v in short.items())}")
            said = True
        time.sleep(1)
    if short:
        raise ConfigError(
            f"the plan's groups need {', '.join(f'{v:g} {k}s' for k, v in short.items())} "
            f"({', '.join(f'{g.name}: {g.ranks} ranks' for g in specs)}); the Ray cluster has "
            f"{', '.join(f'{have.get(k, 0):g} {k}s' for k in short)}: use fewer ranks per "
            "group, fewer CPUs per rank (--group-cpus), or a larger cluster")


def _new_slots(spec: DeviceGroup, bundle: dict[str, float], size: int, count: int,
               opts: RunOptions) -> list[pool.Slot]:
    """`count` placement groups of `size` bundles each, placed (no actors yet); each one's
    bundles ordered by node, first seen first."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    made: list[pool.Slot] = []
    for _ in range(count):
        pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=opts.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for slot in [*made, pool.Slot(pg, bundle, [], [], [])]:
                pool.release(slot)
            raise ConfigError(f"group {spec.name!r} asks for {spec.ranks} ranks of {bundle}; "
                              f"they were not free within {opts.startup_timeout_s:g}s") from None
        where = placement_group_table(pg)["bundles_to_node_id"]
        seen = list(dict.fromkeys(where[b] for b in range(size)))
        order = sorted(range(size), key=lambda b: seen.index(where[b]))
        made.append(pool.Slot(pg, bundle, [], [where[b] for b in order], order))
    return made


def node_split_warning(cfg: RunConfig, spec: DeviceGroup, nodes: list[str]) -> str | None:
    """A warning when a tensor- or context-parallel group of `spec`'s ranks (numbered node by
    node, tp innermost, then cp) spans nodes: its collectives, in every layer, would cross
    the slow inter-node link (the planner never proposes that)."""
    layouts = [model_layout(cfg.plan, spec, m) for m in spec.models]
    if spec.runs("generation"):
        layouts.append(generation_layout(cfg.plan))
    inner = max((x.tp * x.cp for x in layouts), default=1)
    blocks = [set(nodes[i:i + inner]) for i in range(0, len(nodes), inner)]
    if inner == 1 or all(len(b) == 1 for b in blocks):
        return None
    return (f"warning: group {spec.name!r} has tensor/context-parallel groups of {inner} ranks "
            f"that span nodes (ranks by node: {' '.join(nodes)}): every layer's collectives "
            "cross the inter-node link; give each node a multiple of "
            f"{inner} of the group's ranks (--group-cpus, the nodes' sizes) or lower tp/cp")


# A clean run's ranks may take this long to close before they are killed instead of kept: on a
# busy machine Ray's workers (niceness 15) can wait seconds for a core, and a rank discarded
# there costs the next group a process start (several CPU-seconds of imports)
KEEP_CLOSE_S = 60.0


def remove_groups(groups: list[WorkerGroup], wait_s: float, keep: bool = False) -> None:
    """Close every rank (its sandbox pool and process group), kill it and free its bundle,
    waiting `wait_s` for the closes; with `keep` (a run that ended cleanly), a group whose
    ranks all closed after their last call, within `KEEP_CLOSE_S`, is kept for the next group
    of its shape instead (`pool.py`)."""
    import ray
    wait_s = max(wait_s, KEEP_CLOSE_S) if keep else wait_s
    # kept: close on the stage thread, after any call still queued there (an async schedule's
    # prefetch); else on the control thread, which answers while a stage hangs
    control = {} if keep else {"concurrency_group": "control"}
    closing = {g.name: [a.close.options(**control).remote() for a in g.actors]
               for g in groups}
    every = [r for refs in closing.values() for r in refs]
    ready, _ = ray.wait(every, num_returns=len(every), timeout=wait_s)
    for g in groups:
        closed = keep and set(closing[g.name]) <= set(ready) and _succeeded(closing[g.name])
        for slot in g.slots:
            (pool.keep if closed else pool.release)(slot)


def _succeeded(refs: list[Any]) -> bool:
    import ray
    try:
        ray.get(refs)
    except Exception:
        return False
    return True


def start_error(e: BaseException, group: WorkerGroup | None) -> Exception:
    """A worker's constructor raised: the user error it raised (a bad reward model, say),
    else a RuntimeError with its last line."""
    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    name, _, message = last.partition(": ")
    for cls in USER_ERRORS:
        if name.rsplit(".", 1)[-1] == cls.__name__:
            return cls(message)
    where = f"group {group.name!r}" if group else "a group"
    return RuntimeError(f"the worker of {where} failed to start: {last}")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def diagnose(groups: list[WorkerGroup], what: str, step: int, cause: str,
             actor_id: str | None, waited_on: WorkerGroup | None, ping_s: float,
             detected_after_s: float | None) -> WorkerFailure:
    """Ping every rank of every group to tell the dead or silent one from those merely
    waiting (the other ranks of its group wait for it in a collective)."""
    import ray
    from ray.exceptions import RayActorError
    ranks = [(g, r, a) for g in groups for r, a in enumerate(g.actors)]
    pings = [a.ping.options(concurrency_group="control").remote() for _, _, a in ranks]
    ray.wait(pings, num_returns=len(pings), timeout=ping_s)
    states: dict[tuple[str, int], str] = {}
    for (g, r, _), ref in zip(ranks, pings):
        try:
            ray.get(ref, timeout=0.01)
            states[g.name, r] = "is alive"
        except RayActorError:
            states[g.name, r] = "died"
        except Exception:
            states[g.name, r] = f"did not answer a ping within {ping_s:g}s"
    by_id = [(g, r) for g, r, a in ranks if actor_id and a._actor_id.hex() == actor_id]
    dead = [(g, r) for g, r, _ in ranks if states[g.name, r] == "died"]
    silent = [(g, r) for g, r, _ in ranks if states[g.name, r].startswith("did not")]
    g, r = (by_id or dead or silent or [(waited_on or groups[0], 0)])[0]
    return WorkerFailure(g.name, r, g.spec.stages, states[g.name, r], what, step, cause,
                         detected_after_s, g.nodes[r])
