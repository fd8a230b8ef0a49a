"""`plan.adapt`: every N steps the run asks the cost model, calibrated on its own recent
steps, whether another plan on the same devices would run them at least `min_gain` faster
(`perf/validation/advice.py`), and records the answer: a line printed, a row of adapt.jsonl,
`adapt_*` columns in metrics.jsonl and a mark in trace.json. With `dry: false` (Ray runs) the
step loop then checkpoints, rebuilds its groups at the new plan (`switched_config`) and
continues from that checkpoint."""
from __future__ import annotations

import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError, RunConfig
from rlloom.perf.model.compose import Priced, role_models
from rlloom.perf.model.hardware import Hardware, hardware, load_hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.validation.advice import Advice, advise
from rlloom.perf.validation.validate import LoadedRun, critic_shape, measured_step, run_roles
from rlloom.plan import Plan, device_groups, stage_group
from rlloom.runtime.executor.groups import run_models
from rlloom.runtime.outputs.files import append_line


def adapt_hardware(name: str) -> Hardware:
    """`plan.adapt.hardware`: a file, a catalogue name, or local."""
    try:
        return load_hardware(name) if Path(name).is_file() else hardware(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"plan.adapt.hardware={name!r}: {e.args[0]}") from None


class Adapter:
    """Checked when the run starts (the hardware file, the model's shape); `after(row)` with
    every step's metrics row."""

    def __init__(self, cfg: RunConfig, run_dir: Path, model_path: Path) -> None:
        self.cfg, self.settings = cfg, cfg.plan.adapt
        self.hw = adapt_hardware(self.settings.hardware)
        self.last: Advice | None = None
        self.pending: dict[str, Any] | None = None  # the switch being made
        self.switched: dict[str, Any] | None = None  # the one made, until the next decision
        self.models = role_models(model_shape(str(model_path)), run_roles(cfg),
                                  critic=critic_shape(cfg.model))
        self.rows: deque[dict[str, Any]] = deque(maxlen=self.settings.window)
        self.path = run_dir / "adapt.jsonl"

    def after(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The decision at this step (written to adapt.jsonl), or None between decisions."""
        # step 1 pays the warm-up; a step of several sampling rounds is not one priced step
        if row["step"] > 1 and row.get("sample_rounds", 1) == 1 and "response_lens" in row:
            self.rows.append(row)
        if row["step"] % self.settings.every or not self.rows:
            return None
        run = LoadedRun("recent", self.models, self.cfg.plan,
                        [measured_step(r, self.cfg) for r in self.rows], self.cfg.algo.name)
        advice = advise(run, self.hw, statistics.median(r["step_s"] for r in self.rows),
                        keep=self._reachable, ahead=self.settings.every,
                        cap=self.cfg.rollout.max_new_tokens)
        self.last = advice
        record = advice.record(self.settings.min_gain)
        decision = {"step": row["step"], "time": time.time(), "dry": self.settings.dry,
                    **record, "switch": (record["better"] and not self.settings.dry
                                         and row["step"] < self.cfg.train.steps)}
        if self.switched is not None:  # the last switch's prediction, and what came of it
            decision["after_switch"] = {**self.switched, "measured_after_s":
                                        decision["measured_s"]}
            self.switched = None
        if decision["switch"]:
            self.pending = {"step": row["step"], "from": record["plan"], "to": record["best"],
                            "measured_before_s": record["measured_s"],
                            "predicted_after_s": record["best_s"],
                            "predicted_gain": record["gain"]}
        append_line(self.path, json.dumps(decision))
        return decision

    def _reachable(self, p: Priced) -> bool:
        """Whether the run can switch to `p` from its checkpoint: a one-rank training group
        writes whole weights, which a training group of several ranks cannot load."""
        return (training_ranks(self.cfg.plan, self.cfg) > 1
                or training_ranks(p.run_plan(), self.cfg) == 1)

    def switched_config(self) -> RunConfig:
        """The run's config at the last decision's best plan: its placement, schedule and
        layouts (the generation layout too) and its micro-batch as a token budget, as
        `rlloom plan --write-plan` writes them; the run's workload and the adapt settings
        stay."""
        best = self.last.best
        data = self.cfg.model_dump(mode="json")
        data["plan"] = {**best.run_plan().model_dump(mode="json"),
                        "adapt": data["plan"]["adapt"]}
        data["train"]["micro_batch_tokens"] = best.micro_batch_tokens
        return RunConfig.model_validate(data)

    def use(self, cfg: RunConfig) -> None:
        """After a switch: decide about the new plan on its own steps, and report at the next
        decision what the switch predicted and what the new plan measured."""
        self.cfg = cfg
        self.rows.clear()
        self.switched, self.pending = self.pending, None


def training_ranks(plan: Plan, cfg: RunConfig) -> int:
    return stage_group(device_groups(plan, run_models(cfg)), "training").ranks


def decision_line(d: dict[str, Any], min_gain: float) -> str:
    verdict = (f"keeping the plan (< {min_gain:g}x)" if not d["better"] else
               f"a better plan exists (>= {min_gain:g}x); "
               + ("switching to it from this step's checkpoint" if d["switch"]
                  else "not switching (plan.adapt.dry)"))
    after = d.get("after_switch")
    since = (f"since the switch at step {after['step']} measured {after['measured_after_s']:.3g}"
             f" s a step (before it {after['measured_before_s']:.3g} s; predicted "
             f"{after['predicted_after_s']:.3g} s at the lengths then); " if after else "")
    return (f"adapt at step {d['step']} (steps {d['steps'][0]}-{d['steps'][1]}): {since}this plan "
            f"measured {d['measured_s']:.3g} s, priced {d['predicted_s']:.3g} s; at the lengths "
            f"their trend gives the next steps (mean {d['priced_length']:.3g} tokens) the best "
            f"on the same devices is {d['gain']:.2f}x faster ({d['best_s']:.3g} s): "
            f"{d['best']}; {verdict}")
