"""The cluster a Ray run uses, the groups of ranks on it, and how a failed worker is reported:
a local instance with its files under the run directory (or a joined cluster), and the
errors that name the group, stages and rank of a dead or silent worker."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
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

MAX_TEMP_DIR_CHARS = 42  # Ray's socket paths under its temp dir must stay below ~107 chars
USER_ERRORS = (ConfigError, DataError, CheckpointError, LayoutError)


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
    pg: Any
    actors: list[Any]  # rank -> actor handle
    infos: list[dict[str, Any]]  # rank -> pid, host
    nodes: list[str]  # rank -> its node's IP
    node_ids: list[str]  # rank -> its node's Ray id
    bundle: dict[str, float]  # each rank's resources
    binding: list[Any]  # a kept rank's `bind` refs, waited on at start-up

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
    """Each group: a placement group of one bundle per rank (one GPU each on GPU machines)
    and one (not yet started) `worker` actor per bundle, the ranks that share a node numbered
    one after another (so a group's tensor-parallel ranks, innermost, share a node when a
    node holds a multiple of them); refused at once when the cluster cannot hold every rank.
    Nodes other than the driver's get the driver's inputs they lack (`files.ship`)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    gpu = device.type == "cuda"
    need = {"CPU": sum(opts.cpus(g.name) * g.ranks for g in specs),
            "GPU": sum(g.ranks for g in specs) if gpu else 0}
    # a joined cluster may grow (a lost node rejoining, an autoscaler): wait for it
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
    bundles = {g.name: {"CPU": opts.cpus(g.name), **({"GPU": 1.0} if gpu else {})}
               for g in specs}
    kept = {g.name: idle for g in specs
            if (idle := pool.take(g.ranks, bundles[g.name])) is not None}
    pool.make_room({k: sum(bundles[g.name].get(k, 0.0) * g.ranks
                           for g in specs if g.name not in kept) for k in need})
    pgs, order, nodes = {}, {}, {}
    for spec in specs:
        if spec.name in kept:
            pgs[spec.name], nodes[spec.name] = kept[spec.name].pg, kept[spec.name].nodes
            continue
        bundle = bundles[spec.name]
        pg = placement_group([dict(bundle) for _ in range(spec.ranks)], strategy="PACK")
        pgs[spec.name] = pg
        try:
            ray.get(pg.ready(), timeout=opts.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for placed in pgs.values():
                ray.util.remove_placement_group(placed)
            raise ConfigError(f"group {spec.name!r} asks for {spec.ranks} ranks of {bundle}; "
                              f"they were not free within {opts.startup_timeout_s:g}s") from None
        where = placement_group_table(pg)["bundles_to_node_id"]
        seen = list(dict.fromkeys(where[b] for b in range(spec.ranks)))  # first seen first
        order[spec.name] = sorted(range(spec.ranks), key=lambda b: seen.index(where[b]))
        nodes[spec.name] = [where[b] for b in order[spec.name]]
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
        cpus = opts.cpus(spec.name)
        threads = cfg.train.threads or max(1, round(cpus))

        def args(rank: int) -> tuple[Any, ...]:
            return (cfg, str(model_path), spec, rank, threads,
                    "cuda:0" if gpu else "cpu")  # Ray shows each worker its own GPU only
        if spec.name in kept:
            actors = kept[spec.name].actors
            binding = [a.bind.remote(*args(rank), files=shipped.get(nodes[spec.name][rank]))
                       for rank, a in enumerate(actors)]
        else:
            actors = [worker.options(
                num_cpus=cpus, num_gpus=1 if gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pgs[spec.name], bundle),
            ).remote(*args(rank), files=shipped.get(nodes[spec.name][rank]))
                for rank, bundle in enumerate(order[spec.name])]
            binding = []
        groups[spec.name] = WorkerGroup(spec, pgs[spec.name], actors, [], ips[spec.name],
                                        nodes[spec.name], bundles[spec.name], binding)
    return groups


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


def remove_groups(groups: list[WorkerGroup], wait_s: float, keep: bool = False) -> None:
    """Close every rank (its sandbox pool and process group), kill it and free its bundle;
    with `keep` (a run that ended cleanly), a group whose ranks all closed after their last
    call is kept for the next group of its shape instead (`pool.py`)."""
    import ray
    # kept: close on the stage thread, after any call still queued there (an async schedule's
    # prefetch); else on the control thread, which answers while a stage hangs
    control = {} if keep else {"concurrency_group": "control"}
    closing = {g.name: [a.close.options(**control).remote() for a in g.actors]
               for g in groups}
    every = [r for refs in closing.values() for r in refs]
    ready, _ = ray.wait(every, num_returns=len(every), timeout=wait_s)
    for g in groups:
        if keep and set(closing[g.name]) <= set(ready) and _succeeded(closing[g.name]):
            pool.keep(g.spec.ranks, g.bundle, g.pg, g.actors, g.node_ids)
        else:
            pool.release(g.pg, g.actors)


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
