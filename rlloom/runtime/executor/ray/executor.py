"""The executor on Ray: it places the plan's device groups (`plan.device_groups`, each a
group of ranks: `cluster.py`, `worker.GroupWorker`), submits the step loop's calls to every
rank of a group (`loop.StepLoop` runs the schedule), moves batches through the object store
and weights over a process group of their own (`weight_channel.py`).

Faults: every wait has a timeout (`--worker-timeout`) and waits on every rank; a dead or
silent rank is named by group, stages and rank (`cluster.diagnose`); the loop recreates
the groups after a fault while `--max-restarts` allows. Details: docs/ray.md.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig
from rlloom.plan import DeviceGroup
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.executor.groups import group_specs
from rlloom.runtime.executor.hosts import TrainingHost
from rlloom.runtime.executor.interface import GroupCall, RunOptions, WorkerFailure
from rlloom.runtime.executor.loop import StepLoop, weight_copies
from rlloom.runtime.executor.ray import pool
from rlloom.runtime.executor.ray.cluster import (
    USER_ERRORS,
    Cluster,
    WorkerGroup,
    diagnose,
    first_line,
    place_groups,
    remove_groups,
    start_error,
    worker_device,
)
from rlloom.runtime.executor.worker import GroupWorker

PING_S = 5.0


def _remote_class() -> Any:
    import ray
    global _REMOTE
    if _REMOTE is None:
        # stages run one at a time on the default thread; pings, spans and weight pushes get
        # their own threads so they answer while a stage runs
        _REMOTE = ray.remote(concurrency_groups={"control": 2})(GroupWorker)
    return _REMOTE


_REMOTE = None


class RayExecutor:
    """The groups as Ray actors, one per rank; the driver (this process) writes every file."""
    main = True
    label = "rl (ray)"

    def __init__(self, cfg: RunConfig, opts: RunOptions, model_path: Path, run_dir: Path,
                 specs: list[DeviceGroup], has_critic: bool) -> None:
        import ray
        self.cfg, self.opts, self.model_path, self.specs = cfg, opts, model_path, specs
        self.run_dir = run_dir
        self.device = worker_device(cfg.train.device, ray.cluster_resources().get("GPU", 0))
        self.copies = weight_copies(specs, has_critic)
        self.groups: dict[str, WorkerGroup] = {}
        self.started = 0  # times the groups were started: faults are injected in the first
        self.step = 0     # the step a start-up failure is reported at
        self._fault_at: float | None = None
        self._stopped_pids: list[int] = []

    def group(self, name: str) -> WorkerGroup:
        return self.groups[name]

    # -- waiting, with the culprit named ---------------------------------------------------
    def get(self, refs: Any, what: str, step: int, group: WorkerGroup | None = None,
            timeout_s: float | None = None) -> Any:
        import ray
        from ray.exceptions import (
            GetTimeoutError,
            ObjectLostError,
            OwnerDiedError,
            RayActorError,
            RayTaskError,
        )
        timeout_s = timeout_s or self.opts.worker_timeout_s
        try:
            if isinstance(refs, GroupCall):  # every rank's answer waited on, rank 0's returned
                ray.get(refs.refs, timeout=timeout_s)
                return ray.get(refs.lead)
            if isinstance(refs, list) and refs and isinstance(refs[0], GroupCall):
                ray.get([r for c in refs for r in c.refs], timeout=timeout_s)
                return [ray.get(c.lead) for c in refs]
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            raise self._failure(what, step, f"no answer within {timeout_s:g}s", None,
                                group) from None
        except RayActorError as e:
            if getattr(e, "actor_init_failed", False):
                raise start_error(e, group) from None  # deterministic: no restart helps
            raise self._failure(what, step, first_line(e), getattr(e, "actor_id", None),
                                group) from None
        except (ObjectLostError, OwnerDiedError) as e:
            raise self._failure(what, step, first_line(e), None, group) from None
        except RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, USER_ERRORS):
                raise cause from None
            # a rank whose peer died fails its collective (gloo: connection reset) before
            # Ray reports the dead peer: name the dead or silent rank when there is one
            failure = self._failure(what, step, first_line(e), None, group)
            if failure.state != "is alive":
                raise failure from None
            raise

    def answers(self, call: GroupCall) -> list[Any]:
        import ray
        return ray.get(call.refs)

    def first_ready(self, refs: list[Any], what: str, step: int, group: WorkerGroup
                    ) -> list[int]:
        import ray
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.opts.worker_timeout_s)
        if not ready:
            raise self._failure(what, step, f"none within {self.opts.worker_timeout_s:g}s",
                                None, group)
        return [i for i, r in enumerate(refs) if r in ready]

    def put(self, value: Any) -> Any:
        import ray
        return ray.put(value)

    def _failure(self, what: str, step: int, cause: str, actor_id: str | None,
                 waited_on: WorkerGroup | None) -> WorkerFailure:
        detected = (time.perf_counter() - self._fault_at) if self._fault_at else None
        return diagnose(list(self.groups.values()), what, step, cause, actor_id, waited_on,
                        min(PING_S, self.opts.worker_timeout_s), detected)

    # -- groups ------------------------------------------------------------------------------
    def start(self) -> None:
        """Place every group's ranks, then let the ranks meet at rank 0's address and build
        their models (the start-up waits name a group whose rank fails)."""
        import ray
        self.started += 1
        self.groups = place_groups(self.cfg, self.opts, self.specs, self.model_path,
                                   self.run_dir, self.device, _remote_class())
        nodes = {n for g in self.groups.values() for n in g.nodes}
        if len(nodes) > 1:
            print(f"placement on {len(nodes)} nodes (rank by rank): " + ", ".join(
                f"{name} [{' '.join(g.nodes)}]" for name, g in self.groups.items()))
        started = {}
        for name, g in self.groups.items():
            if g.binding:  # kept ranks rebound to this run
                self.get(g.binding, "start-up", self.step, g, self.opts.startup_timeout_s)
            address = (self.get(g.actors[0].address.options(concurrency_group="control")
                                .remote(), "start-up", self.step, g,
                                self.opts.startup_timeout_s) if g.spec.ranks > 1 else None)
            started[name] = g.call(GroupWorker.start, address, self.opts.worker_timeout_s)
        for name, call in started.items():  # building the models happens here
            g = self.groups[name]
            self.get(call, "start-up", self.step, g, self.opts.startup_timeout_s)
            g.infos = [ray.get(r) for r in call.refs]
        self._open_channels()

    def stop(self, reuse: bool = False) -> None:
        """Remove the groups; with `reuse` (the run ended cleanly, or switches plans) their
        ranks are kept for the next groups of their shape (`pool.py`)."""
        for pid in self._stopped_pids:  # a stopped process ignores everything but SIGKILL
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._stopped_pids.clear()
        remove_groups(list(self.groups.values()), PING_S, keep=reuse)
        self.groups.clear()

    def _open_channels(self) -> None:
        """Join training rank 0 and the ranks of each copy's group in a channel of their own
        (`weight_channel.WeightChannel`: NCCL on GPUs, gloo on CPUs)."""
        lead = next(g for g in self.groups.values() if g.spec.runs("training")).actors[0]
        for name, what in self.copies:
            g = self.groups[name]
            address = self.get(lead.address.options(concurrency_group="control").remote(),
                               "start-up", self.step, g, self.opts.startup_timeout_s)
            world, timeout = 1 + g.spec.ranks, self.opts.worker_timeout_s
            joins = [lead.open_channel.remote(what, address, 0, world, timeout)]
            joins += [a.open_channel.remote(what, address, 1 + i, world, timeout)
                      for i, a in enumerate(g.actors)]
            self.get(joins, "start-up", self.step, g, self.opts.startup_timeout_s)

    def inject(self, step: int) -> None:
        """Test hook: kill (SIGKILL) or stop (SIGSTOP) a group's worker as step `step` runs."""
        self.step = step
        if not self.opts.fault or self.started > 1 or self._fault_at is not None:
            return
        kind, where, at = self.opts.fault.split(":")
        if int(at) != step:
            return
        group, _, rank = where.partition("/")
        info = self.groups[group].infos[int(rank or 0)]
        time.sleep(0.2)  # let the step's requests start
        if info["host"] != socket.gethostname():
            raise ConfigError("fault injection signals a local worker; this one runs on "
                              f"{info['host']}")
        os.kill(info["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        if kind == "stop":
            self._stopped_pids.append(info["pid"])
        self._fault_at = time.perf_counter()
        print(f"fault injection: {kind} worker rank {info['rank']} of group {group!r} (pid "
              f"{info['pid']}) during step {step}")

    def watch(self, on_stage: Callable[[str], None]) -> None:
        """Stages run in the workers; the loop names each one as it waits on it."""

    def spans(self) -> list[dict]:
        """Every group's spans since the last call (rank 0 speaks for its group)."""
        events = self.get([g.actors[0].drain_spans.options(concurrency_group="control")
                           .remote() for g in self.groups.values()], "trace spans", self.step)
        return [e for evs in events for e in evs]

    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> None:
        """The checkpoint, written by the driver; a training group of several ranks writes
        its DCP shards into it first, every rank its own."""
        train = next(g for g in self.groups.values() if g.spec.runs("training"))

        def shards(tmp: Path) -> None:
            self.get(train.call(TrainingHost.save_shards, tmp), "checkpoint", step, train)
        save_state(run_dir, step, state, keep, write=shards if train.spec.ranks > 1 else None)

    def barrier(self) -> None:
        """Nothing to wait for: the driver alone writes."""


@contextmanager
def ray_loop(cfg: RunConfig, run_dir: Path, opts: RunOptions, model_path: Path
             ) -> Iterator[StepLoop]:
    """The step loop over the plan's groups as Ray actors, on a cluster started (or joined)
    for the run and stopped after it."""
    specs = group_specs(cfg)
    cluster = Cluster(opts, run_dir, sum(opts.cpus(g.name) * g.ranks for g in specs))
    if cluster.note:
        print(cluster.note)
    try:
        has_critic = "critic" in PRESETS[cfg.algo.name].roles

        def rebuild(new: RunConfig) -> tuple[RayExecutor, list[DeviceGroup]]:
            """Groups for another plan of the run (plan.adapt's switch)."""
            new_specs = group_specs(new)
            return RayExecutor(new, opts, model_path, run_dir, new_specs, has_critic), new_specs
        ex = RayExecutor(cfg, opts, model_path, run_dir, specs, has_critic)
        yield StepLoop(cfg, run_dir, ex, model_path, specs, opts, rebuild)
    finally:
        if cluster.owned or not pool.keep_across_runs():
            pool.evict()
        cluster.stop()
