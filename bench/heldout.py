"""The performance model held out on this machine's runs (docs/performance-model.md section
10): `rlloom bench hw`, then `--sets` sets of three runs of the built-in job (32 x 8, 16 x 4
and 64 x 8 rollouts a step, `--steps` steps), each run calibrated and the other two of its
set validated, and the noise between identical runs (every set has the same seeds, so step s
of run 32 x 8 has the same workload in every set).

    python bench/heldout.py [--sets 3] [--steps 8] [--out runs/heldout]

Runs one after another, about two minutes a set on a 2-core machine.
"""
import argparse
import itertools
import statistics
import subprocess
from pathlib import Path

from rlloom.perf.model.hardware import load_hardware
from rlloom.perf.validation.validate import calibrate, load_run, price_run, stage_errors

SETTINGS = (("32x8", 32, 8), ("16x4", 16, 4), ("64x8", 64, 8))


def rlloom(*args: str) -> None:
    subprocess.run(["rlloom", *args], check=True, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sets", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="runs/heldout")
    a = p.parse_args()
    out = Path(a.out)
    hw_file = out / "local.json"
    rlloom("bench", "hw", "--out", str(hw_file))
    hw = load_hardware(hw_file)
    sets = []
    for s in range(a.sets):
        runs = []
        for name, prompts, k in SETTINGS:
            run = out / f"set{s}" / name
            rlloom("train", f"run_dir={run}", f"train.steps={a.steps}", "eval.every=100000",
                   f"train.prompts_per_step={prompts}", f"rollout.n_samples={k}")
            runs.append(run)
        sets.append(runs)
        print(f"set {s} done", flush=True)
    print(f"{'fitted on':<14} {'scale':>6} {'attn_eff':>9} {'own':>6} {'held-out':>9} "
          f"{'per step':>9}  worst held-out stage")
    held = []
    for runs in sets:
        for fit_run in runs:
            fit = calibrate([fit_run], hw)
            others = [pt for r in runs if r != fit_run
                      for pt in price_run(load_run(r), fit.hardware)]
            errors = stage_errors(others)
            median = statistics.median(abs(e) for e in errors.values())
            held.append(median)
            (run, stage), worst = max(errors.items(), key=lambda kv: abs(kv[1]))
            print(f"{fit_run.parent.name + '/' + fit_run.name:<14} "
                  f"{fit.hardware.compute_eff:>6.2f} {fit.hardware.attn_eff:>9.2f} "
                  f"{fit.after:>6.1%} {median:>9.1%} "
                  f"{statistics.median(abs(pt.error) for pt in others):>9.1%}  "
                  f"{stage} of {run} {worst:+.1%}")
    print(f"held-out median over {len(held)} fits: {statistics.median(held):.1%}; within 10%: "
          f"{sum(h <= 0.10 for h in held)} of {len(held)}")
    # identical workloads in different sets: the host's noise, a floor under the errors
    means, steps = [], []
    for i in range(len(SETTINGS)):
        for x, y in itertools.combinations([runs[i] for runs in sets], 2):
            sx, sy = load_run(x).steps, load_run(y).steps
            for stage in ("generation", "assessment", "training"):
                mx = [measured[stage] for _, _, measured in sx]
                my = [measured[stage] for _, _, measured in sy]
                means.append(abs(sum(my) / sum(mx) - 1))
                steps += [abs(b / c - 1) for b, c in zip(my, mx)]
    if means:
        print(f"identical runs differ by a median {statistics.median(means):.1%} per stage "
              f"mean (up to {max(means):.1%}) and {statistics.median(steps):.1%} per step")


if __name__ == "__main__":
    main()
