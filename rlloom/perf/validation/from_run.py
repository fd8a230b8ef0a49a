"""`rlloom plan --from-run RUN_DIR`: what a finished run would have gained from another plan.

The hardware file is calibrated on the run itself (`validate.calibrate`, not saved), the
workload is the run's (its rollouts per step, prompt length and every response length it
generated, pooled over the steps after the warm-up), the devices are those its plan used,
and the planner ranks every plan on them. The report prices the run's own plan next to the
best one with the same calibrated file, so their ratio is the gain the model predicts, and
shows what the run measured beside what its plan is predicted at: how far to trust it."""
from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable

from rlloom.perf.model.compose import Priced, price
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.workload import Lengths
from rlloom.perf.search.planner import describe, search
from rlloom.perf.validation.validate import calibrate, load_run


def _measured_step_s(run_dir: Path, steps: set[int]) -> float:
    """The median of the run's measured step times (`step_s`: from one step's end to the
    next, so an async run's overlapped stages count once) over `steps`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_s"] for r in rows if r["step"] in steps)


def from_run_report(run_dir: Path, hw: Hardware, top: int,
                    tick: Callable[[], None] = lambda: None) -> tuple[str, Priced, str]:
    """The report, the best plan found and the run's algorithm (for --write-plan); `tick()`
    follows each calibration point priced."""
    run = load_run(run_dir)
    if not run.steps:
        raise ValueError(f"{run_dir}: no steps after the first to learn from; run longer")
    fit = calibrate([run_dir], hw, tick=tick)
    fitted = fit.hardware
    lengths = [n for _, wl, _ in run.steps for n in wl.response.values]
    wl = replace(run.steps[-1][1], response=Lengths.empirical(lengths),
                 prompts=round(statistics.mean(w.prompts for _, w, _ in run.steps)),
                 prompt_len=round(statistics.mean(w.prompt_len for _, w, _ in run.steps)))
    own = price(run.plan, run.models, wl, fitted)
    measured = _measured_step_s(run_dir, {step for step, _, _ in run.steps})
    found = search(run.models["actor"], run.algo, wl, fitted, own.devices,
                   reward=run.models.get("reward"), critic=run.models.get("critic"),
                   roles=tuple(run.models))
    if not found.ranked:
        raise ValueError(f"no plan fits {own.devices} devices of {hw.name} for this run")
    best = found.ranked[0]
    ordered = sorted(lengths)
    lines = [
        f"from {run_dir}: {len(run.steps)} steps after the warm-up, {wl.prompts} prompts x "
        f"{wl.samples} samples, response lengths p50 {ordered[len(ordered) // 2]} p99 "
        f"{ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]} (max "
        f"{ordered[-1]}), {own.devices} devices",
        f"hardware {hw.name} calibrated on the run: compute_eff {fitted.compute_eff:.2f}, "
        f"mem_eff {fitted.mem_eff:.2f}, attn_eff {fitted.attn_eff:.2f}; stage |error| "
        f"{fit.before:.1%} -> {fit.after:.1%}",
        f"the run's plan: measured {measured:.3g} s per step (median step_s), predicted "
        f"{own.step_s:.3g} s: "
        f"{describe(run.plan, own.gen_layout, own.micro_batch)}",
        f"{'step s':>8} {'vs run':>7}  plan (best {min(top, len(found.ranked))} of "
        f"{len(found.ranked)} on the same devices)"]
    for p in found.ranked[:top]:
        lines.append(f"{p.step_s:8.3g} {own.step_s / p.step_s:6.2f}x  "
                     f"{describe(p.plan, p.gen_layout, p.micro_batch)}")
    gain = own.step_s / best.step_s
    lines.append(f"the best plan would have taken {best.step_s:.3g} s per step instead of "
                 f"{own.step_s:.3g} (both priced with the calibrated file): {gain:.2f}x"
                 + ("; the run's plan was already the best" if gain < 1.005 else ""))
    return "\n".join(lines), best, run.algo
