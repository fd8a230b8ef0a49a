"""The driver of the executor on Ray: it starts the plan's device groups
(`plan.device_groups`, each a group of ranks: `ray_cluster`, `ray_workers`), runs the
plan's schedule over them, moves batches through the object store and weights over a process
group of their own (`weight_channel.py`).

Schedules, one loop (`train_step`):
- sync: generation -> assessment -> training with barriers (eta = 0).
- fused: generation runs in `fused_chunks` requests of whole prompts; each chunk's
  assessment forwards are submitted as the chunk arrives (`ray.wait`), then advantages are
  computed over the whole batch and training follows.
- async (staleness eta): generation of step i+eta is submitted once step i-1's weights are
  synced, so it runs while step i trains; samples more than eta versions old are generated
  again; stale samples are corrected as decoupled PPO (`hosts.decoupled`) for ppo and
  decoupled_ppo. Assessment on a group of its own is prefetched too; on the training group
  it is submitted with its own step, or it would queue ahead of the training it overlaps.
  Groups that generate and train take turns (FIFO order keeps the staleness semantics).

Faults: every wait has a timeout (`--worker-timeout`) and waits on every rank; a dead or
silent rank is named by group, stages and rank; with `--max-restarts N` the driver
recreates the groups, reloads the last checkpoint (whole weights from a one-rank training
group, DCP shards from a larger one) and continues. Details: docs/ray.md.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlloom.algos.kl import kl_controller
from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig
from rlloom.plan import stage_group
from rlloom.runtime.checkpoint import checkpoint_dirs, load_latest
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.executor.hosts import DECOUPLED_LOSSES, save_final, step_row
from rlloom.runtime.executor.ray_cluster import (
    USER_ERRORS,
    GroupCall,
    WorkerFailure,
    WorkerGroup,
    diagnose,
    first_line,
    place_groups,
    remove_groups,
    start_error,
    worker_device,
)
from rlloom.runtime.executor.ray_plan import (
    RayOptions,
    group_specs,
    state_keys,
)
from rlloom.runtime.executor.ray_workers import GroupWorker
from rlloom.runtime.outputs.metrics import MetricsLog
from rlloom.runtime.outputs.plots import plot_run
from rlloom.runtime.outputs.progress import progress_bar
from rlloom.runtime.outputs.tracing import Tracer

PROGRESS_KEYS = ("reward", "accuracy", "kl", "eval_accuracy", "step_s", "staleness")
PING_S = 5.0


@dataclass
class InFlight:
    """A step's generation and assessment, submitted but not yet consumed."""
    batch: Any        # ObjectRef[Batch] (rank 0's)
    ginfo: Any        # GroupCall or ObjectRef of dict (version, seconds)
    exp: Any          # ObjectRef[Experience] (rank 0's); None until assessment is submitted
    ainfo: Any        # GroupCall of dict; None until then


def _remote_class() -> Any:
    import ray
    global _REMOTE
    if _REMOTE is None:
        # stages run one at a time on the default thread; pings, spans and weight pushes get
        # their own threads so they answer while a stage runs
        _REMOTE = ray.remote(concurrency_groups={"control": 2})(GroupWorker)
    return _REMOTE


_REMOTE = None


# -- the driver ------------------------------------------------------------------------------

class RayRun:
    def __init__(self, cfg: RunConfig, run_dir: Path, opts: RayOptions, model_path: Path
                 ) -> None:
        self.cfg, self.run_dir, self.opts, self.model_path = cfg, run_dir, opts, model_path
        self.specs = group_specs(cfg)
        import ray
        self.device = worker_device(cfg.train.device, ray.cluster_resources().get("GPU", 0))
        self.eta = cfg.plan.staleness if cfg.plan.schedule == "async" else 0
        self.correct = self.eta > 0 and cfg.algo.policy_loss in DECOUPLED_LOSSES
        self.has_critic = "critic" in PRESETS[cfg.algo.name].roles
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.tracer = Tracer(run_dir / "trace.json")
        self.groups: dict[str, WorkerGroup] = {}
        self.inflight: dict[int, InFlight] = {}
        self.failures: list[dict[str, Any]] = []
        self.attempt = 0
        self._fault_at: float | None = None
        self._stopped_pids: list[int] = []
        self._reset_state()

    def _reset_state(self) -> None:
        a = self.cfg.algo
        self.kl = kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)
        self.step = 0
        self.eval_history: list[tuple[int, float]] = []

    def _host(self, stage: str) -> WorkerGroup:
        return self.groups[stage_group(self.specs, stage).name]

    # -- waiting, with the culprit named ---------------------------------------------------
    def _get(self, refs: Any, what: str, step: int, group: WorkerGroup | None = None,
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
            raise

    def _failure(self, what: str, step: int, cause: str, actor_id: str | None,
                 waited_on: WorkerGroup | None) -> WorkerFailure:
        detected = (time.perf_counter() - self._fault_at) if self._fault_at else None
        return diagnose(list(self.groups.values()), what, step, cause, actor_id, waited_on,
                        min(PING_S, self.opts.worker_timeout_s), detected)

    # -- groups ------------------------------------------------------------------------------
    def _start_groups(self) -> None:
        """Place every group's ranks, then let the ranks meet at rank 0's address and build
        their models (the start-up waits name a group whose rank fails)."""
        import ray
        self.groups = place_groups(self.cfg, self.opts, self.specs, self.model_path,
                                   self.device, _remote_class())
        started = {}
        for name, g in self.groups.items():
            address = (self._get(g.actors[0].address.options(concurrency_group="control")
                                 .remote(), "start-up", self.step, g,
                                 self.opts.startup_timeout_s) if g.spec.ranks > 1 else None)
            started[name] = g.call("start", address, self.opts.worker_timeout_s)
        for name, call in started.items():  # building the models happens here
            g = self.groups[name]
            self._get(call, "start-up", self.step, g, self.opts.startup_timeout_s)
            g.infos = [ray.get(r) for r in call.refs]
        self._open_channels()

    def _stop_groups(self) -> None:
        for pid in self._stopped_pids:  # a stopped process ignores everything but SIGKILL
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._stopped_pids.clear()
        remove_groups(list(self.groups.values()), PING_S)
        self.groups.clear()
        self.inflight.clear()

    # -- state -------------------------------------------------------------------------------
    def _restore(self, from_checkpoint: bool) -> None:
        import ray
        state = load_latest(self.run_dir) if from_checkpoint else None
        if state is None:
            self._reset_state()
            self.metrics.truncate_after(0)
            self.tracer.events = []
            return
        self.step = state["step"]
        self.kl.value = state["kl_coef"]
        self.eval_history = [tuple(e) for e in state["eval_history"]]
        latest = checkpoint_dirs(self.run_dir)[-1]
        shards = str(latest) if (latest / "actor").is_dir() else None
        train = self._host("training")
        if shards is None and train.spec.ranks > 1:
            raise ConfigError(f"{latest} holds whole weights (written by a one-rank training "
                              f"group); group {train.name!r} has {train.spec.ranks} ranks: resume "
                              "it with plan.layouts.actor on one device, then change layouts at "
                              "the next checkpoint")
        loads = [g.call("load_state", {k: v for k, v in state.items()
                                       if k in state_keys(g.spec.stages)}, shards)
                 for g in self.groups.values()
                 if g.spec.runs("training") or g.spec.runs("generation")]
        self._get(loads, "checkpoint loading", self.step)
        self.metrics.truncate_after(self.step)
        self.tracer.drop_after(self.step)
        self._sync(self.step)
        for item in state.get("ray", {}).get("buffered", []):
            if self.step < item["step"] <= self.cfg.train.steps:
                self._submit(item["step"], ray.put(item["batch"]), ray.put(item["info"]))

    def _checkpoint(self) -> None:
        buffered = []
        gen = self._host("generation")
        for j in sorted(self.inflight):
            item = self.inflight[j]
            info = self._get(item.ginfo, "generation", j, gen)
            buffered.append({"step": j, "batch": self._get(item.batch, "generation", j, gen),
                             "info": info})
        train = self._host("training")
        tstate, gstate = self._get([train.call("training_state"),
                                    gen.call("generation_state")], "checkpoint", self.step)
        state = {"step": self.step, **tstate, "kl_coef": self.kl.value, **gstate,
                 "eval_history": list(self.eval_history), "ray": {"buffered": buffered}}

        def shards(tmp: Path) -> None:  # every training rank writes its own
            self._get(train.call("save_shards", str(tmp)), "checkpoint", self.step, train)
        save_state(self.run_dir, self.step, state, self.cfg.checkpoint.keep,
                   write=shards if train.spec.ranks > 1 else None)
        self.tracer.save()

    # -- stages ------------------------------------------------------------------------------
    def _submit(self, step: int, batch: Any = None, ginfo: Any = None) -> None:
        """Generation (unless given) and, on a group of its own, assessment of `step`; nothing
        waits here. Assessment that shares the training group is submitted with its own step
        (`_assessed`): a worker runs calls in submission order, so a prefetched assessment
        would queue ahead of the training it should overlap and wait for the next batch."""
        if batch is None:
            call = self._host("generation").call("generate", step, num_returns=2)
            batch, ginfo = call.part(0).lead, call.part(1)
        self.inflight[step] = InFlight(batch, ginfo, None, None)
        if self._host("assessment") is not self._host("training"):
            self._assessed(step, self.inflight[step])

    def _assessed(self, step: int, item: InFlight) -> InFlight:
        if item.exp is None:
            call = self._host("assessment").call("assess", step, item.batch, self.kl.value,
                                                 num_returns=2)
            item.exp, item.ainfo = call.part(0).lead, call.part(1)
        return item

    def _generated(self, step: int) -> tuple[Any, dict, Any, list[dict]]:
        """Experience ref, generation info and assessment info ref of a sync or async step
        (training is submitted before assessment ends: only the version check waits)."""
        gen = self._host("generation")
        for j in range(step, min(step + self.eta, self.cfg.train.steps) + 1):
            if j not in self.inflight:
                self._submit(j)
        self._inject(step)
        dropped = 0
        while True:
            item = self.inflight.pop(step)
            ginfo = self._get(item.ginfo, "generation", step, gen)
            if step - 1 - ginfo["version"] <= self.eta:
                break
            # generated by weights older than the staleness bound allows: regenerate
            dropped += ginfo["rollouts"]
            self._submit(step)
        ginfo["dropped"] = dropped
        item = self._assessed(step, item)
        return item.exp, ginfo, item.ainfo, [ginfo]

    def _fused(self, step: int) -> tuple[Any, dict, Any, list[dict]]:
        """Chunks of prompts generate one after another; each is assessed as it arrives."""
        import ray
        gen, ass = self._host("generation"), self._host("assessment")
        b = self.cfg.train.prompts_per_step
        sizes = [len(c) for c in torch.arange(b).chunk(min(self.opts.fused_chunks, b))]
        chunks = {}
        for c, n in enumerate(sizes):
            call = gen.call("generate", step, n, num_returns=2)
            chunks[call.part(1).lead] = (c, call)
        self._inject(step)
        pending, infos, assessed = list(chunks), [], []
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=self.opts.worker_timeout_s)
            if not ready:
                raise self._failure("a generated chunk", step, "no chunk within "
                                    f"{self.opts.worker_timeout_s:g}s", None, gen)
            for ref in ready:
                c, call = chunks[ref]
                infos.append(self._get(call.part(1), "generation", step, gen))
                assessed.append(ass.call("assess_chunk", step, c, call.part(0).lead))
        # the chunks' results as arguments: a failed chunk fails the merge with its error
        merged = ass.call("finish_assessment", step, self.kl.value,
                          *[r for a in assessed for r in a.refs], num_returns=2)
        exp, ainfo = merged.part(0).lead, merged.part(1)
        ginfo = {"gen_s": sum(i["gen_s"] for i in infos),
                 "score_s": sum(i["score_s"] for i in infos), "dropped": 0,
                 "version": min(i["version"] for i in infos)}
        return exp, ginfo, ainfo, infos

    def _copies(self) -> list[tuple[WorkerGroup, str]]:
        """(group, "policy" or "critic") for every group that holds a copy of trained weights:
        a generation group apart from training, an assessment group scoring a critic."""
        train = self._host("training")
        gen, ass = self._host("generation"), self._host("assessment")
        return ([(gen, "policy")] if gen is not train else []) + (
            [(ass, "critic")] if self.has_critic and ass is not train else [])

    def _open_channels(self) -> None:
        """Join training rank 0 and the ranks of each copy's group in a channel of their own
        (`weight_channel.WeightChannel`: NCCL on GPUs, gloo on CPUs)."""
        lead = self._host("training").actors[0]
        for g, what in self._copies():
            address = self._get(lead.address.options(concurrency_group="control").remote(),
                                "start-up", self.step, g, self.opts.startup_timeout_s)
            world, timeout = 1 + g.spec.ranks, self.opts.worker_timeout_s
            joins = [lead.open_channel.remote(what, address, 0, world, timeout)]
            joins += [a.open_channel.remote(what, address, 1 + i, world, timeout)
                      for i, a in enumerate(g.actors)]
            self._get(joins, "start-up", self.step, g, self.opts.startup_timeout_s)

    def _sync(self, step: int) -> tuple[float, int]:
        """Broadcast the trainer's weights (gathered whole on training rank 0) over each copy's
        channel to every rank of its group; seconds, and the bytes one receiving rank takes
        in (what the cost model prices: `perf.comm.broadcast_between_groups` of the whole
        model)."""
        import ray
        copies = self._copies()
        if not copies:
            return 0.0, 0
        t0 = time.perf_counter()
        train = self._host("training")
        calls = []
        for g, what in copies:
            calls += [train.call("send_weights", what),  # a collective over the training ranks
                      g.call("receive_weights", what, step, step, self.opts.worker_timeout_s,
                             control=True)]
        self._get(calls, "weight sync", step, copies[0][0])
        received = [max(d["bytes"] for d in ray.get(call.refs)) for call in calls[1::2]]
        return time.perf_counter() - t0, sum(received)

    def _inject(self, step: int) -> None:
        """Test hook: kill (SIGKILL) or stop (SIGSTOP) a group's worker as step `step` runs."""
        if not self.opts.fault or self.attempt > 0 or self._fault_at is not None:
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

    def _drain_spans(self) -> None:
        groups = list(self.groups.values())
        # rank 0 speaks for its group (the others keep no spans)
        events = self._get([g.actors[0].drain_spans.options(concurrency_group="control")
                            .remote() for g in groups], "trace spans", self.step)
        for evs in events:
            self.tracer.events.extend(evs)

    def _evaluate(self) -> float:
        train = self._host("training")
        acc = self._get(train.call("evaluate", self.step), "evaluation", self.step, train)
        self.eval_history.append((self.step, acc))
        return acc

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        step = self.step + 1
        exp, ginfo, ainfo, infos = (self._fused(step) if self.cfg.plan.schedule == "fused"
                                    else self._generated(step))
        train = self._host("training")
        stats = train.call("train", step, exp, self.kl.value, self.correct)
        ainfo = self._get(ainfo, "assessment", step, self._host("assessment"))
        stats = self._get(stats, "training", step, train)
        self.step = step
        sync_s, sync_bytes = self._sync(step)
        lags: dict[str, int] = {}
        for info in infos:
            lag = str(step - 1 - info["version"])
            lags[lag] = lags.get(lag, 0) + info.get("rollouts", 0)
        behaviour = stats.pop("behaviour_kl", 0.0)
        row, kl_now = step_row(ginfo, ainfo, stats, self.kl.value)
        row.update({  # what the Ray runtime adds
            "staleness": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
            "staleness_hist": lags, "dropped": ginfo["dropped"], "behaviour_kl": behaviour,
            "sync_s": sync_s, "sync_bytes": sync_bytes})
        self.kl.update(kl_now, len(row["response_lens"]))
        return {"step": step, **row, "step_s": time.perf_counter() - t0}

    def _loop(self) -> None:
        cfg = self.cfg
        if self.step == 0 and not self.eval_history:
            print(f"held-out greedy accuracy before RL: {self._evaluate():.3f}")
        with progress_bar("rl (ray)", cfg.train.steps, done=self.step) as bar:
            while self.step < cfg.train.steps:
                row = self.train_step()
                if self.step % cfg.eval.every == 0 or self.step == cfg.train.steps:
                    row["eval_accuracy"] = self._evaluate()
                self.metrics.append(row)
                self._drain_spans()
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps:
                    self._checkpoint()
                bar.advance(**{k: row.get(k) for k in PROGRESS_KEYS})

    def _final(self) -> dict[str, float]:
        train = self._host("training")
        weights = self._get(train.call("policy_weights"), "the final weights", self.step)
        save_final(self.cfg, self.model_path, weights, self.run_dir / "final")
        self._drain_spans()
        self.tracer.save()
        plot_run(self.metrics.rows(), self.eval_history, self.run_dir / "summary.png")
        before, after = self.eval_history[0][1], self.eval_history[-1][1]
        print(f"held-out greedy accuracy: before RL {before:.3f}, after RL {after:.3f} "
              f"({100 * (after - before):+.1f} points)")
        return {"eval_before": before, "eval_after": after,
                "restarts": float(self.attempt)}

    def run(self, resume: bool = False) -> dict[str, float]:
        """Train to `train.steps`, recreating the groups after a worker fault while
        `max_restarts` allows."""
        try:
            while True:
                try:
                    self._start_groups()
                    self._restore(from_checkpoint=resume or self.attempt > 0)
                    self._loop()
                    return self._final()
                except WorkerFailure as f:
                    self.failures.append(f.record())
                    with (self.run_dir / "failures.jsonl").open("a") as out:
                        out.write(json.dumps(f.record()) + "\n")
                    self._stop_groups()
                    if self.attempt >= self.opts.max_restarts:
                        raise
                    self.attempt += 1
                    print(f"{f}\nrestart {self.attempt} of {self.opts.max_restarts}: "
                          "recreating the groups from the last checkpoint")
        finally:
            self._stop_groups()
