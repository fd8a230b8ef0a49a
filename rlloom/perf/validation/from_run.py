"""`rlloom plan --from-run RUN_DIR`: what a finished run would have gained from another plan
(`advice.advise` on its steps after the warm-up, with the measured `step_s`)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Callable

from rlloom.perf.model.compose import Priced
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.search.planner import describe
from rlloom.perf.validation.advice import advise, shown
from rlloom.perf.validation.validate import load_run


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
    measured = (_measured_step_s(run_dir, {step for step, _, _ in run.steps})
                if run.steps else 0.0)
    advice = advise(run, hw, measured, tick)
    wl, own, fitted = advice.workload, advice.own, advice.fit.hardware
    lengths = wl.response
    lines = [
        f"from {run_dir}: {len(run.steps)} steps after the warm-up, {wl.prompts} prompts x "
        f"{wl.samples} samples, response lengths p50 {lengths.p50:g} p99 "
        f"{lengths.quantile(0.99):g} (max {lengths.max:g}), {own.devices} devices",
        f"hardware {hw.name} calibrated on the run: compute_eff {fitted.compute_eff:.2f}, "
        f"mem_eff {fitted.mem_eff:.2f}, attn_eff {fitted.attn_eff:.2f}; stage |error| "
        f"{advice.fit.before:.1%} -> {advice.fit.after:.1%}",
        f"the run's plan: measured {measured:.3g} s per step (median step_s), predicted "
        f"{own.step_s:.3g} s: "
        f"{describe(shown(run.plan, advice.roles), own.gen_layout, own.micro_batch)}",
        f"{'step s':>8} {'vs run':>7}  plan (best {min(top, len(advice.found.ranked))} of "
        f"{len(advice.found.ranked)} on the same devices)"]
    for p in advice.found.ranked[:top]:
        lines.append(f"{p.step_s:8.3g} {own.step_s / p.step_s:6.2f}x  "
                     f"{describe(p.plan, p.gen_layout, p.micro_batch)}")
    lines.append(f"the best plan would have taken {advice.best.step_s:.3g} s per step instead "
                 f"of {own.step_s:.3g} (both priced with the calibrated file): "
                 f"{advice.gain:.2f}x"
                 + ("; the run's plan was already the best" if advice.gain < 1.005 else ""))
    return "\n".join(lines), advice.best, run.algo
