"""Colocated sync against disaggregated async at equal devices, with long-tailed response
lengths, measured next to the performance model:
``python bench/schedules.py [--repeats 3] [--steps 12] [--max-new 256]
[--difficulty "{1: 0.94, 16: 0.06}"]``.

The arms run interleaved, A B A B ..., `--repeats` times each, so a slow spell of a shared
machine falls on both; the speed-up is each pair's ratio, reported as the median with its
range, and the predicted speed-up as an interval: the pairs' predicted ratios, widened by the
hardware file's relative error (`perf.model.interval.hardware_error`) on each arm's side.

Both arms run 2 one-thread ranks of one CPU each on Ray:
- colocated sync dp2: one group of 2 ranks; each generates half the prompts (the K samples
  of a prompt stay together) on its copy and trains on half of every mini-batch;
- disaggregated async (eta=1) 1:1: a generation rank and a training rank; generation of step
  i+1 runs while step i trains, fed by weight sync.
No reference model (kl_coef=0), so no third group. The task is the built-in arith task with
a difficulty mixture: 94% of the prompts take one operation and 6% take sixteen, and the
tiny model is warm-started on worked solutions only (sft.direct_fraction=0), so most
responses are about a dozen tokens and a few are ten times longer, the long tail of
reasoning RL (the script prints p50 and p99; the target is p99/p50 >= 8).

Step time is the median interval between the ends of consecutive training spans (trace.json)
after the warm-up steps, so an async pipeline's overlap shows. The predicted step time has the
same definition on the simulator's timeline of the run's own steps: each step priced by
`rlloom.perf.model.compose.price` with the run's plan and that step's response lengths (as
`rlloom perf validate` prices a run), placed by `rlloom.perf.validation.simulate.timeline`, so a
long step's generation delays its own training as it does in the run. The hardware file is this
machine's (`rlloom bench hw`). Its `call_s`, the driver's round trip per stage call and rank,
comes from `rlloom perf calibrate` on an earlier invocation's runs (kept with --out), which
measures it from their traces; the efficiency factors that command also fits are not
determined by this bench's one run size (docs/ray.md), so the figures there keep the file's
efficiencies and take `call_s` alone.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rlloom.config import load_config
from rlloom.perf.model.interval import Interval, hardware_error
from rlloom.perf.validation.simulate import timeline
from rlloom.perf.validation.validate import load_run
from rlloom.runtime.executor.interface import RunOptions
from rlloom.runtime.executor.launch import train

WARMUP = 2
ARMS = {  # name -> plan overrides
    "colocated sync dp2": ["plan.layouts.actor.dp=2"],
    "disaggregated async 1:1": ["plan.placement=disaggregated", "plan.schedule=async",
                                "plan.staleness=1"],
}


def _median_interval(ends: list[tuple[int, float]], warmup: int) -> float:
    """Median interval between consecutive training ends (step, time) of the steps from
    `warmup` on (the median: other jobs on a shared machine add spikes)."""
    ends = [t for step, t in sorted(ends) if step >= warmup]
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def step_interval(run: Path, warmup: int) -> float:
    """The run's measured step time: `_median_interval` of its training spans (trace.json)."""
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    return _median_interval([(e["args"]["step"], (e["ts"] + e["dur"]) / 1e6) for e in events
                             if e["name"] == "training"], warmup)


def predicted(runs: dict[str, list[Path]]) -> tuple[dict[str, list[float]], float] | None:
    """Each arm's predicted step time per repeat, defined as the measured one: the run's own
    steps (its plan, each step's own lengths) placed on the groups' timelines by
    `rlloom.perf.validation.simulate.timeline`, and `_median_interval` of their ends; and the
    hardware file's relative error."""
    from rlloom.perf.model.hardware import hardware
    try:
        hw = hardware("local")
    except KeyError as e:
        print(f"no predicted column: {e.args[0]}")
        return None
    out: dict[str, list[float]] = {}
    for name, dirs in runs.items():
        for run in dirs:
            loaded = load_run(run, skip=0)
            sim = timeline(loaded.plan, loaded.models, [wl for _, wl, _ in loaded.steps], hw)
            numbered = zip((step for step, _, _ in loaded.steps), sim.step_ends)
            out.setdefault(name, []).append(_median_interval(list(numbered), WARMUP + 1))
    return out, hardware_error(hw)


def _dir(arm: str, repeat: int) -> str:
    return f"{arm.replace(' ', '_').replace(':', '-')}_{repeat}"


def run_arms(a: argparse.Namespace, base: Path) -> dict[str, list[float]]:
    """Run the arms interleaved, `a.repeats` times each, on a local Ray instance of 2 CPUs;
    their measured step times, by arm, in run order."""
    import ray
    temp = tempfile.mkdtemp(prefix="rlb-", dir="/tmp")
    ray.init(num_cpus=2, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    overrides = ["model.hidden_size=64", "model.layers=2", "model.heads=2", "model.kv_heads=1",
                 f"data.difficulty={a.difficulty}", "data.train_size=120",
                 "data.eval_size=16", f"sft.steps={a.sft_steps}", "sft.batch_size=16",
                 "sft.direct_fraction=0", f"train.steps={a.steps}",
                 f"train.prompts_per_step={a.prompts}", f"rollout.n_samples={a.samples}",
                 f"rollout.max_new_tokens={a.max_new}", f"rollout.temperature={a.temperature}",
                 "algo.kl_coef=0", "eval.max_new_tokens=16", "eval.every=1000",
                 "checkpoint.every=1000", "train.threads=1"]
    measured: dict[str, list[float]] = {name: [] for name in ARMS}
    try:
        for i in range(a.repeats):
            for name, plan_overrides in ARMS.items():
                run = base / _dir(name, i)
                shutil.rmtree(run, ignore_errors=True)
                cfg = load_config(None, [*overrides, *plan_overrides, f"run_dir={run}"])
                t0 = time.perf_counter()
                train(cfg, None, RunOptions(worker_timeout_s=600), ray=True)
                measured[name].append(step_interval(run, WARMUP + 1))
                print(f"{name} #{i + 1}: {measured[name][-1]:.3f} s/step "
                      f"({time.perf_counter() - t0:.0f}s with start-up)", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each arm, interleaved")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-new", type=int, default=256, help="rollout.max_new_tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--difficulty", default="{1: 0.94, 16: 0.06}", help="data.difficulty: "
                    "arith operations, or a mixture {operations: weight}")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--sft-steps", type=int, default=200, help="warm start of the tiny model")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--reprice", action="store_true", help="measure and price the runs "
                    "already in --out (after `rlloom perf calibrate`, say) without running")
    a = ap.parse_args()
    if a.reprice and not a.out:
        ap.error("--reprice needs --out, the directory of an earlier run of this bench")
    base = Path(a.out or tempfile.mkdtemp(prefix="rlloom-bench-"))
    runs = {name: [base / _dir(name, i) for i in range(a.repeats)] for name in ARMS}
    measured = (run_arms(a, base) if not a.reprice else
                {name: [step_interval(d, WARMUP + 1) for d in dirs]
                 for name, dirs in runs.items()})
    pred = predicted(runs)
    first = runs["colocated sync dp2"][0]
    lens = sorted(n for line in (first / "metrics.jsonl").read_text().splitlines()
                  for n in json.loads(line)["response_lens"])
    q = {p: lens[int(p * (len(lens) - 1))] for p in (0.5, 0.9, 0.99)}
    print(f"\nresponse lengths (colocated run): p50 {q[0.5]}, p90 {q[0.9]}, p99 {q[0.99]} "
          f"(p99/p50 {q[0.99] / q[0.5]:.1f}) of {a.max_new}; {a.prompts}x{a.samples} "
          f"rollouts/step; 2 ranks of 1 thread per arm (os.cpu_count()={os.cpu_count()})")
    print(f"step time after {WARMUP} warm-up steps, {a.repeats} interleaved runs per arm")
    print(f"{'arm':<26}{'measured s (each run)':>30}{'predicted s':>22}")
    for name, times in measured.items():
        print(f"{name:<26}{' '.join(f'{t:.3f}' for t in times):>30}"
              + (f"{' '.join(f'{t:.3f}' for t in pred[0][name]):>22}" if pred else ""))
    ratios = [c / d for c, d in zip(measured["colocated sync dp2"],
                                    measured["disaggregated async 1:1"])]
    median = statistics.median(ratios)
    line = (f"speed-up of async over colocated sync: measured median {median:.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} pairs)")
    if pred:
        (times, h) = pred
        p = [c / d for c, d in zip(times["colocated sync dp2"], times["disaggregated async 1:1"])]
        # the hardware error may move either arm either way
        iv = Interval(min(p) * (1 - h) / (1 + h), statistics.median(p),
                      max(p) * (1 + h) / (1 - h))
        inside = iv.low <= median <= iv.high
        line += (f"; predicted {iv.mid:.2f}x, interval {iv}x (+-{iv.half_width:.0%}, "
                 f"hardware error {h:.1%}): the measured median is "
                 f"{'inside' if inside else 'OUTSIDE'} it")
    print(line)
    if a.out is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
