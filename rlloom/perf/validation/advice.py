"""Whether another plan would run a run's recent steps faster: the one computation behind
`rlloom plan --from-run` (a finished run) and `plan.adapt` (a running one).

The hardware file is calibrated on the steps themselves (`validate.fit_runs`); the workload
is theirs (mean rollouts per step and prompt length, every response length pooled); the
devices and roles are those the run's plan uses; the planner ranks every plan on them. The
run's plan and the best are priced with the same calibrated file, so their ratio is the gain
the model predicts, and the run's measured step time beside its plan's price says how far to
trust it."""
from __future__ import annotations

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
    own: Priced  # the run's plan, priced with the calibrated file
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
                "predicted_s": self.own.step_s,
                "best": describe(self.best.plan, self.best.gen_layout, self.best.micro_batch),
                "best_s": self.best.step_s, "gain": self.gain,
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


def advise(run: LoadedRun, hw: Hardware, measured_s: float,
           tick: Callable[[], None] = lambda: None,
           keep: Callable[[Priced], bool] = lambda p: True) -> Advice:
    """The run's plan against the best on its devices that `keep` accepts, both priced with
    `hw` calibrated on the run's steps; `measured_s` is their measured step time."""
    if not run.steps:
        raise ValueError("no steps to learn from after the warm-up; run longer")
    fit = fit_runs([run], hw, tick)
    lengths = [n for _, wl, _ in run.steps for n in wl.response.values]
    wl = replace(run.steps[-1][1], response=Lengths.empirical(lengths),
                 prompts=round(statistics.mean(w.prompts for _, w, _ in run.steps)),
                 prompt_len=round(statistics.mean(w.prompt_len for _, w, _ in run.steps)))
    own = price(run.plan, run.models, wl, fit.hardware)
    found = search(run.models["actor"], run.algo, wl, fit.hardware, own.devices,
                   reward=run.models.get("reward"), critic=run.models.get("critic"),
                   roles=tuple(run.models))
    found.ranked = [p for p in found.ranked if keep(p)]
    if not found.ranked:
        raise ValueError(f"no plan fits {own.devices} devices of {hw.name} for this run")
    roles = tuple(r for r, shape in run.models.items() if shape is not None)
    return Advice([s for s, _, _ in run.steps], wl, fit, measured_s, own, found, roles)
