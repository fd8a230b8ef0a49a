"""Whether another plan would run a run's recent steps faster: the one computation behind
`rlloom plan --from-run` (a finished run) and `plan.adapt` (a running one).

The hardware file is calibrated on the steps themselves (`validate.fit_runs`); the workload
is theirs (mean rollouts per step and prompt length, every response length pooled); the
devices and roles are those the run's plan uses; the planner ranks every plan on them. The
run's plan and the best are priced with the same calibrated file, so their ratio is the gain
the model predicts, and the run's measured step time beside its plan's price says how far to
trust it."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any, Callable

from rlloom.perf.model.compose import Priced, price
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import Search, describe, search
from rlloom.perf.validation.validate import Fit, LoadedRun, fit_runs
from rlloom.plan import Plan


@dataclass(frozen=True)
class Advice:
    steps: list[int]  # the steps learnt from
    workload: Workload  # theirs, lengths pooled
    fit: Fit
    measured_s: float  # their median measured step time
    own: Priced  # the run's plan, priced with the calibrated file (at `workload`)
    own_now: Priced  # ... at the steps' own lengths, the price `measured_s` is beside
    found: Search  # every plan on the same devices, best first
    roles: tuple[str, ...]  # the models the run builds

    @property
    def best(self) -> Priced:
        return self.found.ranked[0]

    @property
    def gain(self) -> float:
        """How much faster the best plan is predicted to be than the run's."""
        return self.own.step_s / self.best.step_s

    def record(self, min_gain: float) -> dict[str, Any]:
        return {"steps": [self.steps[0], self.steps[-1]], "measured_s": self.measured_s,
                "plan": describe(shown(self.own.plan, self.roles), self.own.gen_layout,
                                 self.own.micro_batch),
                "predicted_s": self.own_now.step_s,
                "best": describe(self.best.plan, self.best.gen_layout, self.best.micro_batch),
                "best_s": self.best.step_s, "gain": self.gain,
                # the run's plan at the lengths the decision prices for, and their mean
                "predicted_next_s": self.own.step_s,
                "priced_length": statistics.mean(self.workload.response.values),
                "better": self.gain >= min_gain,
                "calibration": {"compute_eff": self.fit.hardware.compute_eff,
                                "attn_eff": self.fit.hardware.attn_eff,
                                "factors": self.fit.factors,
                                "stage_error": self.fit.after}}


def shown(plan: Plan, roles: tuple[str, ...]) -> Plan:
    """`plan` with the layout `Plan.layout` gives each trained or scoring model it names
    none (one device), so a description says where every model runs."""
    held = [r for r in ("actor", "critic", "reference") if r in roles]
    return plan.model_copy(update={"layouts": {**{r: plan.layout(r) for r in held},
                                               **plan.layouts}})


def projected_lengths(steps: list[tuple[int, Workload, dict]], ahead: int,
                      cap: int | None) -> list[float]:
    """Every response length of `steps`, pooled, scaled by their trend: the least-squares line
    through each step's mean length, read `ahead` / 2 steps past the last (the middle of the
    stretch a decision prices for), over the pooled mean; at most x4 either way and `cap` (the
    run's max_new_tokens) per response. `ahead` 0 (a finished run): as they were."""
    lengths = [float(n) for _, wl, _ in steps for n in wl.response.values]
    if ahead <= 0 or len(steps) < 2:
        return lengths
    xs = [float(step) for step, _, _ in steps]
    ys = [statistics.mean(wl.response.values) for _, wl, _ in steps]
    slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    at = statistics.mean(ys) + slope * (xs[-1] + ahead / 2 - statistics.mean(xs))
    scale = min(max(at / statistics.mean(lengths), 0.25), 4.0)
    return [max(1.0, min(n * scale, cap or math.inf)) for n in lengths]


def advise(run: LoadedRun, hw: Hardware, measured_s: float,
           tick: Callable[[], None] = lambda: None,
           keep: Callable[[Priced], bool] = lambda p: True, ahead: int = 0,
           cap: int | None = None) -> Advice:
    """The run's plan against the best on its devices that `keep` accepts, both priced with
    `hw` calibrated on the run's steps, at their lengths projected `ahead` steps by their
    trend (`projected_lengths`); `measured_s` is their measured step time."""
    if not run.steps:
        raise ValueError("no steps to learn from after the warm-up; run longer")
    fit = fit_runs([run], hw, tick)
    now = replace(run.steps[-1][1],
                  response=Lengths.empirical([n for _, w, _ in run.steps
                                              for n in w.response.values]),
                  prompts=round(statistics.mean(w.prompts for _, w, _ in run.steps)),
                  prompt_len=round(statistics.mean(w.prompt_len for _, w, _ in run.steps)))
    own_now = price(run.plan, run.models, now, fit.hardware)
    wl, own = now, own_now
    if ahead > 0:
        wl = replace(now, response=Lengths.empirical(projected_lengths(run.steps, ahead, cap)))
        own = price(run.plan, run.models, wl, fit.hardware)
    found = search(run.models["actor"], run.algo, wl, fit.hardware, own.devices,
                   reward=run.models.get("reward"), critic=run.models.get("critic"),
                   roles=tuple(run.models))
    found.ranked = [p for p in found.ranked if keep(p)]
    if not found.ranked:
        raise ValueError(f"no plan fits {own.devices} devices of {hw.name} for this run")
    roles = tuple(r for r, shape in run.models.items() if shape is not None)
    return Advice([s for s, _, _ in run.steps], wl, fit, measured_s, own, own_now, found,
                  roles)
