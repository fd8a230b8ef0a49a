"""The executor's one step loop: the plan's schedule over its device groups, whatever runs the
groups (`Executor`: Ray actors of `ray/executor.py`, or this process and its torchrun peers,
`local.py`). Every placement, schedule and layout runs through this loop; a one-rank group is
the one-process case of the same calls.

Schedules (sync, fused, async): `schedules.py`, which produces each step's experience.

Offline algorithms (DPO-style) train on preference pairs in place of the three stages.
Faults (Ray): every wait has a timeout and waits on every rank; with `max_restarts` the loop
recreates the groups, reloads the last checkpoint and continues (docs/ray.md).
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlloom.algos.kl import kl_controller
from rlloom.algos.presets import DECOUPLED_LOSSES, PRESETS
from rlloom.config import ConfigError, RunConfig, dump_config
from rlloom.models.hf_io import read_model_config
from rlloom.plan import DeviceGroup, stage_group
from rlloom.runtime.checkpoint import checkpoint_dirs, load_latest
from rlloom.runtime.executor.adapt import Adapter, decision_line
from rlloom.runtime.executor.groups import state_keys
from rlloom.runtime.executor.hosts import PreferenceHost, TrainingHost, step_row
from rlloom.runtime.executor.interface import Executor, Group, RunOptions, WorkerFailure
from rlloom.runtime.executor.policy import save_final
from rlloom.runtime.executor.schedules import schedule_for
from rlloom.runtime.executor.worker import GroupWorker
from rlloom.runtime.outputs.files import append_line, naming, write_atomic
from rlloom.runtime.outputs.metrics import MetricsLog
from rlloom.runtime.outputs.plots import plot_run
from rlloom.runtime.outputs.progress import progress_bar
from rlloom.runtime.outputs.tracing import Tracer
from rlloom.runtime.outputs.trackers import closing_all, open_trackers
from rlloom.runtime.stages.evaluate import score_name, score_term
from rlloom.runtime.stages.nonfinite import NonFiniteStop, stop_message
from rlloom.runtime.stop_signals import Stopped, StopSignals

# the offline (DPO) line leads with its loss and reward accuracy; online lines with rewards
OFFLINE_PROGRESS_KEYS = ("loss", "pref_accuracy", "margin", "step_s", "train_s")
PROGRESS_KEYS = ("reward", "accuracy", "pref_accuracy", "kl", "tool_calls",
                 "step_s", "gen_s", "assess_s", "train_s", "staleness")


def weight_copies(groups: list[DeviceGroup], has_critic: bool) -> list[tuple[str, str]]:
    """(group, "policy" or "critic") for every group that holds a copy of trained weights,
    refreshed by weight sync after each step: a generation group apart from training, an
    assessment group scoring a critic."""
    train = stage_group(groups, "training")
    gen, ass = stage_group(groups, "generation"), stage_group(groups, "assessment")
    return ([(gen.name, "policy")] if gen is not train else []) + (
        [(ass.name, "critic")] if has_critic and ass is not train else [])


class PlanSwitch(Exception):
    """plan.adapt found a better plan: the groups are rebuilt for `cfg` from the checkpoint
    of this step."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__("switching plans")
        self.cfg = cfg


class StepLoop:
    def __init__(self, cfg: RunConfig, run_dir: Path, ex: Executor, model_path: Path,
                 specs: list[DeviceGroup], opts: RunOptions,
                 rebuild: Callable[[RunConfig], tuple[Executor, list[DeviceGroup]]] | None
                 = None) -> None:
        self.run_dir, self.model_path, self.opts, self.rebuild = run_dir, model_path, opts, rebuild
        self._bind(cfg, ex, specs)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.tracer = Tracer(run_dir / "trace.json")
        self.failures: list[dict[str, Any]] = []
        self.attempt = 0
        self._flat = 0  # steps in a row whose every advantage was 0
        self.adapter = (Adapter(cfg, run_dir, model_path)
                        if cfg.plan.adapt.every and self.main else None)
        self._reset_state()

    def _bind(self, cfg: RunConfig, ex: Executor, specs: list[DeviceGroup]) -> None:
        """Run `cfg`'s plan on `ex`'s groups (at the start, and after a plan switch)."""
        self.cfg, self.ex, self.specs = cfg, ex, specs
        self.online = PRESETS[cfg.algo.name].online
        # stale samples, or tokens of older weights in a partial rollout, are corrected
        stale = (cfg.plan.schedule == "async" and cfg.plan.staleness > 0
                 or cfg.rollout.partial_tokens > 0)
        self.correct = stale and cfg.algo.policy_loss in DECOUPLED_LOSSES
        self.copies = weight_copies(specs, "critic" in PRESETS[cfg.algo.name].roles)
        self.schedule = schedule_for(cfg, self.opts, ex, self._host, self._get,
                                     lambda: self.kl.value)

    def _reset_state(self) -> None:
        self._switch_to: RunConfig | None = None
        a = self.cfg.algo
        self.kl = kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)
        self.step = 0
        self.eval_history: list[tuple[int, float]] = []
        # the progress bar's stage display, while a bar is up
        self._on_stage: Callable[[str], None] = lambda name: None

    def _host(self, stage: str) -> Group:
        return self.ex.group(stage_group(self.specs, stage).name)

    def _get(self, refs: Any, what: str, step: int, group: Group | None = None) -> Any:
        self._on_stage(what)
        return self.ex.get(refs, what, step, group)

    # -- state -------------------------------------------------------------------------------
    def restore(self, from_checkpoint: bool) -> bool:
        """Load the newest checkpoint into every group (True), or start afresh (False);
        forget metrics and spans logged after it."""
        found = load_latest(self.run_dir) if from_checkpoint else None
        if found is None:
            self._reset_state()
            if self.main:
                self.metrics.truncate_after(0)
            self.tracer.events = []
            return False
        latest, state = found
        self.step = state["step"]
        self.kl.value = state["kl_coef"]
        self.eval_history = [tuple(e) for e in state["eval_history"]]
        shards = str(latest) if (latest / "actor").is_dir() else None
        train = self._host("training")
        if shards is None and train.spec.ranks > 1:
            raise ConfigError(f"{latest} holds whole weights (written by a one-rank training "
                              f"group); group {train.name!r} has {train.spec.ranks} ranks: resume "
                              "it with plan.layouts.actor on one device, then change layouts at "
                              "the next checkpoint")
        loads = [self.ex.group(g.name).call(GroupWorker.load_state, {
            k: v for k, v in state.items() if k in state_keys(g.stages)}, shards)
            for g in self.specs if g.runs("training") or g.runs("generation")]
        self._get(loads, "checkpoint loading", self.step)
        if self.main:  # one writer: two ranks racing on the same rename lose the log
            self.metrics.truncate_after(self.step)
        self.tracer.drop_after(self.step)
        self._sync(self.step)
        for item in state.get("buffered", []):
            if self.step < item["step"] <= self.cfg.train.steps:
                self.schedule.submit(item["step"], self.ex.put(item["batch"]),
                                     self.ex.put(item["info"]))
        return True

    def checkpoint(self) -> None:
        """checkpoints/step_NNNNNN, atomically, with the batches generated ahead (async) and,
        from a group of several training ranks, their DCP shards."""
        buffered = self.schedule.buffered() if self.online else []
        train = self._host("training")
        tstate, gstate = self._get([train.call(TrainingHost.state),
                                    self._host("generation").call(GroupWorker.generation_state)],
                                   "checkpoint", self.step)
        state = {"step": self.step, **tstate, "kl_coef": self.kl.value, **gstate,
                 "eval_history": list(self.eval_history), "buffered": buffered,
                 "config": dump_config(self.cfg)}
        self.ex.save(self.run_dir, self.step, state, self.cfg.checkpoint.keep)
        self._save_trace()

    FLAT_STEPS = 3  # steps in a row with no learning signal before the run says so
    ZERO_FOR_EQUAL_GROUPS = ("grpo", "dr_grpo", "rloo")  # estimators that give such groups 0

    def _warn_if_nothing_learns(self, row: dict[str, float]) -> None:
        """Says once when, for FLAT_STEPS steps in a row, every group's rewards were equal
        under a group-relative estimator: every advantage was 0, so nothing was learned."""
        flat = (row.get("frac_zero_std_groups") == 1.0
                and self.cfg.algo.advantage in self.ZERO_FOR_EQUAL_GROUPS)
        self._flat = self._flat + 1 if flat else 0
        if self._flat == self.FLAT_STEPS:
            print(f"warning: steps {self.step - self.FLAT_STEPS + 1}-{self.step}: every prompt's "
                  f"{self.cfg.rollout.n_samples} responses scored alike (frac_zero_std_groups=1), "
                  f"so every {self.cfg.algo.advantage} advantage was 0 and nothing was learned; "
                  "check that the reward can tell responses apart, sample more responses per "
                  "prompt (rollout.n_samples) or raise rollout.temperature",
                  file=sys.stderr)

    def _save_trace(self) -> None:
        self.tracer.events += self.ex.spans()
        if self.main:
            self.tracer.save()

    # -- stages ------------------------------------------------------------------------------
    def _sync(self, step: int) -> tuple[float, int]:
        """Broadcast the trainer's weights (gathered whole on training rank 0) over each copy's
        channel to every rank of its group; seconds, and the bytes one receiving rank takes
        in (what the cost model prices: `perf.model.comm.broadcast_between_groups` of the whole
        model). Groups that train and generate read the trainer's own weights: no sync."""
        if not self.copies:
            return 0.0, 0
        t0 = time.perf_counter()
        train = self._host("training")
        calls = []
        for name, what in self.copies:
            # a collective over the training ranks, and the copy's ranks receiving
            calls += [train.call(GroupWorker.send_weights, what),
                      self.ex.group(name).call(GroupWorker.receive_weights, what, step, step,
                                               self.opts.worker_timeout_s, control=True)]
        self._get(calls, "weight sync", step, self.ex.group(self.copies[0][0]))
        received = [max(d["bytes"] for d in self.ex.answers(call)) for call in calls[1::2]]
        return time.perf_counter() - t0, sum(received)

    def evaluate(self) -> dict[str, float] | None:
        """The held-out scores now (`stages/evaluate.py`), or None when the run has no
        held-out problems; the accuracy joins the eval history."""
        train = self._host("training")
        scores = self._get(train.call(GroupWorker.evaluate, self.step), "evaluation", self.step,
                           train)
        if scores is not None:
            self.eval_history.append((self.step, scores.pop("score")))
        return scores

    def _online_step(self, step: int) -> dict[str, Any]:
        exp, ginfo, ainfo, infos = self.schedule.experience(step)
        train = self._host("training")
        stats = train.call(TrainingHost.train, step, exp, self.kl.value, self.correct)
        ainfo = self._get(ainfo, "assessment", step, self._host("assessment"))
        stats = self._get(stats, "training", step, train)
        sync_s, sync_bytes = self._sync(step)
        sync_s += sum(i["engine_sync_s"] for i in infos)
        sync_bytes += sum(i["engine_sync_bytes"] for i in infos)
        lags: dict[str, int] = {}
        for info in infos:
            lag = str(step - 1 - info["version"])
            lags[lag] = lags.get(lag, 0) + info.get("rollouts", 0)
        tokens = sum(i["tokens"] for i in infos)
        behaviour = stats.pop("behaviour_kl", 0.0)
        row, kl_now = step_row(ginfo, ainfo, stats, self.kl.value)
        row.update({
            "staleness": sum(int(k) * v for k, v in lags.items()) / max(sum(lags.values()), 1),
            "staleness_hist": lags, "dropped": ginfo["dropped"], "behaviour_kl": behaviour,
            # versions behind the trained weights, per response token (partial rollouts carry
            # tokens of older versions)
            "token_staleness": step - 1 - sum(i["token_version"] * i["tokens"]
                                               for i in infos) / max(tokens, 1),
            "sync_s": sync_s, "sync_bytes": sync_bytes})
        self.kl.update(kl_now, len(row["response_lens"]))
        return row

    def _offline_step(self, step: int) -> dict[str, Any]:
        train = self._host("training")
        stats = self._get(train.call(PreferenceHost.train, step), "training", step, train)
        return {**stats, "gen_s": 0.0, "assess_s": 0.0}

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        step = self.step + 1
        row = self._online_step(step) if self.online else self._offline_step(step)
        self.step = step
        return {"step": step, **row, "step_s": time.perf_counter() - t0}

    def _loop(self) -> None:
        cfg = self.cfg
        if self.step == 0 and not self.eval_history:
            before = self.evaluate()
            if self.main:
                print(f"held-out {score_name(cfg)} before {self._phase}: "
                      f"{self.eval_history[-1][1]:.3f}" if before is not None
                      else "no held-out evaluation: this run has no held-out problems, or "
                      "nothing to score them with (set data.eval_file to rows your reward "
                      "functions or the task's verifier can score)")
        trackers = (open_trackers(cfg.log.trackers, self.run_dir, cfg.model_dump(mode="json"),
                                  dump_config(cfg), cfg.log.project, self.step + 1)
                    if self.main else [])
        with progress_bar(self.ex.label, cfg.train.steps, done=self.step,
                          show=self.main, every=1) as bar, closing_all(trackers), \
                StopSignals() as signals:
            self._on_stage = bar.stage
            self.ex.watch(bar.stage)
            while self.step < cfg.train.steps:
                row = self.train_step()
                if row.get("nonfinite"):  # train.on_nonfinite=stop: nothing of it is kept
                    kept = checkpoint_dirs(self.run_dir)
                    raise NonFiniteStop(stop_message(
                        self.step, row["nonfinite"], cfg.train.lr,
                        str(kept[-1]) if kept else None, str(self.run_dir), row))
                if self.step % cfg.eval.every == 0 or self.step == cfg.train.steps:
                    scores = self.evaluate()
                    if scores is not None:
                        row.update(scores)
                if self.adapter is not None:
                    self._adapt(row)
                if self.main:
                    self.metrics.append(row)
                    self._warn_if_nothing_learns(row)
                for tracker in trackers:
                    tracker.log(row, self.step)
                halt = self.main and any([cb(dict(row)) is False for cb in self.opts.callbacks])
                # read once: a signal that lands after the checkpoint decision waits for the
                # next step's boundary, where it has a checkpoint to name
                stop = signals.received
                if (self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps
                        or stop or halt):
                    self.checkpoint()
                else:
                    self.tracer.events += self.ex.spans()
                tokens = sum(row.get("response_lens", ()))
                keys = PROGRESS_KEYS if self.online else OFFLINE_PROGRESS_KEYS
                evaluated = self.eval_history and self.eval_history[-1][0] == self.step
                bar.advance(**{k: row.get(k) for k in keys},
                            eval=self.eval_history[-1][1] if evaluated else None,
                            tok_per_s=tokens / row["step_s"] if tokens else None)
                if halt and self.step < cfg.train.steps:
                    print(f"a callback stopped the run after step {self.step}")
                    break
                if stop and self.step < cfg.train.steps:
                    raise Stopped(f"{signals.name} received: stopped after step {self.step} of "
                                  f"{cfg.train.steps}, checkpoint written to "
                                  f"{checkpoint_dirs(self.run_dir)[-1]}; continue with rlloom "
                                  f"train --resume {self.run_dir}", 128 + stop)
                if self._switch_to is not None and self.step < cfg.train.steps:
                    if self.step % cfg.checkpoint.every:  # the new plan starts from here
                        self.checkpoint()
                    raise PlanSwitch(self._switch_to)

    def _adapt(self, row: dict[str, Any]) -> None:
        """plan.adapt's decision at this step, if it is one: printed, in the row (adapt_*)
        and marked in the trace."""
        decision = self.adapter.after(row)
        if decision is None:
            return
        print(decision_line(decision, self.cfg.plan.adapt.min_gain))
        row.update(adapt_gain=decision["gain"], adapt_predicted_s=decision["predicted_s"],
                   adapt_best_s=decision["best_s"])
        if decision["switch"]:
            self._switch_to = self.adapter.switched_config()
        self.tracer.events.append({"name": "adapt", "ph": "i", "s": "g", "pid": "plan",
                                   "tid": "adapt", "ts": decision["time"] * 1e6,
                                   "args": {k: v for k, v in decision.items() if k != "time"}})

    def _final(self) -> dict[str, float]:
        train = self._host("training")
        weights = self._get(train.call(GroupWorker.policy_weights), "the final weights", self.step)
        evals = self.eval_history or [(0, math.nan)]
        before, after = evals[0][1], evals[-1][1]
        if self.main:
            with naming(self.run_dir / "final"):
                save_final(self.cfg, self.model_path, weights, self.run_dir / "final")
            self._save_trace()
            with naming(self.run_dir / "summary.png"):
                plot_run(self.metrics.rows(), self.eval_history, self.run_dir / "summary.png")
            if self.eval_history:
                # an accuracy (the verifier's, or DPO's pair accuracy) changes in points
                share = score_term(self.cfg) == "correct" or not self.online
                change = f"{100 * (after - before):+.1f} points" if share else \
                    f"{after - before:+.3f}"
                print(f"held-out {score_name(self.cfg)}: before {self._phase} {before:.3f}, "
                      f"after {self._phase} {after:.3f} ({change})")
        self.ex.barrier()
        return {"eval_before": before, "eval_after": after, "restarts": float(self.attempt)}

    @property
    def _phase(self) -> str:
        return "RL" if self.online else "training"

    @property
    def main(self) -> bool:
        return self.ex.main

    def run(self, resume: bool = False) -> dict[str, float]:
        """Train to `train.steps`, recreating the groups after a worker fault while
        `max_restarts` allows."""
        try:
            switched = False
            while True:
                try:
                    self.ex.start()
                    restored = self.restore(from_checkpoint=resume or self.attempt > 0
                                            or switched)
                    if restored and self.main and self.attempt == 0 and not switched:
                        print(f"resuming {self.run_dir} at step {self.step}")
                    self._loop()
                    result = self._final()
                    self.ex.stop(reuse=True)
                    return result
                except PlanSwitch as switch:
                    self.ex.stop(reuse=True)
                    self.schedule.clear()
                    self._switch_to = None
                    self._bind(switch.cfg, *self.rebuild(switch.cfg))
                    self.adapter.use(switch.cfg)
                    # whole or not at all: a resume reads the plan its checkpoint is for
                    write_atomic(self.run_dir / "config.yaml", dump_config(
                        switch.cfg, read_model_config(self.model_path).describe()))
                    switched = True
                except WorkerFailure as f:
                    self.failures.append(f.record())
                    append_line(self.run_dir / "failures.jsonl", json.dumps(f.record()))
                    self.ex.stop()
                    self.schedule.clear()
                    if self.attempt >= self.opts.max_restarts:
                        raise
                    self.attempt += 1
                    print(f"{f}\nrestart {self.attempt} of {self.opts.max_restarts}: "
                          "recreating the groups from the last checkpoint")
        finally:
            self.ex.stop()
