"""plan.adapt against a fixed plan, at equal devices, on a run whose responses grow:
``python bench/adapt.py [--steps 40] [--every 5] [--max-new 128] [--out DIR]``.

Both arms start from colocated sync with the actor at dp2 (2 one-thread ranks of one CPU on
Ray) and reward length (a reward function of completion tokens / --max-new, beside nothing
else), so the mean response length grows several-fold over the run, as reasoning lengths
grow in RL. The fixed arm keeps its plan; the adaptive arm runs `plan.adapt` (every --every
steps, dry=false, this machine's hardware file: `rlloom bench hw` first) and switches when
the calibrated model finds a plan at least 1.15x faster on the same 2 ranks. The arms run one
after the other, twice, A B A B, so a slow spell of the shared machine falls on both.

Reported per pair: the growth of the mean response length, wall time of each run (start-up
included) and the time each spends outside its steps (the adaptive run's extra there is
its decisions and its switch), the step at which the adaptive run switched, the median step
time after the switch in each arm (steps after the first one at the new plan) and its ratio,
the measured gain, next to the gain the decision predicted at the lengths of its window,
and the gain the same model (the hardware file calibrated on that window) predicts at the
lengths each arm then generated (the median over those steps of each step priced with its own
lengths): the decision cannot know the later lengths, the second column says how much of the
miss is the lengths' growth and how much the model.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rlloom.config import load_config
from rlloom.runtime.executor.interface import RunOptions
from rlloom.runtime.executor.launch import train

LENGTH = '''
def length(completion_ids, **columns):
    return [len(ids) / {max_new} for ids in completion_ids]
'''


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(overrides: list[str], run: Path) -> float:
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    train(load_config(None, [*overrides, f"run_dir={run}"]), None,
          RunOptions(worker_timeout_s=600), ray=True)
    return time.perf_counter() - t0


def _at_later_lengths(fixed: Path, adapt: Path, switch: dict, later: range) -> float:
    """The gain of the switched plan over the fixed one priced by the decision's model (the
    hardware file calibrated on the adaptive run's window before the switch) at the lengths
    each arm generated in `later` steps."""
    from rlloom.perf.model.compose import price
    from rlloom.perf.validation.validate import LoadedRun, fit_runs, load_run
    from rlloom.runtime.executor.adapt import adapt_hardware
    before, after = load_run(fixed, skip=0), load_run(adapt, skip=0)
    first, last = switch["steps"]
    window = [s for s in after.steps if first <= s[0] <= last]  # at the fixed arm's plan
    fit = fit_runs([LoadedRun("window", before.models, before.plan, window, before.algo)],
                   adapt_hardware("local"))

    def median_s(run: LoadedRun) -> float:
        return statistics.median(price(run.plan, run.models, wl, fit.hardware).step_s
                                 for step, wl, _ in run.steps if step in later)
    return median_s(before) / median_s(after)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="plan.adapt.every")
    ap.add_argument("--max-new", type=int, default=128, help="rollout.max_new_tokens")
    ap.add_argument("--pairs", type=int, default=2, help="fixed/adaptive pairs, interleaved")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    a = ap.parse_args()
    import ray
    base = Path(a.out or tempfile.mkdtemp(prefix="rlloom-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    reward = base / "length_reward.py"
    reward.write_text(LENGTH.format(max_new=a.max_new))
    common = ["model.hidden_size=64", "model.layers=2", "model.heads=2", "model.kv_heads=1",
              "data.difficulty=1", "data.train_size=200", "data.eval_size=16",
              "sft.steps=100", "sft.batch_size=16", f"train.steps={a.steps}",
              "train.prompts_per_step=8", "rollout.n_samples=4",
              f"rollout.max_new_tokens={a.max_new}", "algo.kl_coef=0", "train.lr=3e-4",
              f"reward.functions=[{reward}:length]", "eval.every=1000",
              "checkpoint.every=1000", "train.threads=1", "plan.layouts.actor.dp=2"]
    adaptive = [f"plan.adapt.every={a.every}", "plan.adapt.dry=false",
                f"plan.adapt.window={a.every}"]
    temp = tempfile.mkdtemp(prefix="rlb-", dir="/tmp")
    ray.init(num_cpus=2, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    results = []
    try:
        for i in range(a.pairs):
            fixed_s = _run(common, base / f"fixed_{i}")
            adapt_s = _run(common + adaptive, base / f"adaptive_{i}")
            results.append((i, fixed_s, adapt_s))
            print(f"pair {i + 1}: fixed {fixed_s:.1f} s, adaptive {adapt_s:.1f} s", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"\n{a.steps} steps, 8 prompts x 4 samples, up to {a.max_new} tokens, 2 ranks")
    for i, fixed_s, adapt_s in results:
        fixed, adapt = _rows(base / f"fixed_{i}"), _rows(base / f"adaptive_{i}")
        means = [statistics.mean(r["response_lens"]) for r in fixed]
        decisions = [json.loads(x) for x in (base / f"adaptive_{i}" / "adapt.jsonl")
                     .read_text().splitlines()]
        switch = next((d for d in decisions if d["switch"]), None)
        # start-up, evaluation, checkpoints; the adaptive run's decisions and its switch too
        outside = [wall - sum(r["step_s"] for r in rows)
                   for wall, rows in ((fixed_s, fixed), (adapt_s, adapt))]
        print(f"pair {i + 1}: mean response length {statistics.mean(means[:3]):.0f} -> "
              f"{statistics.mean(means[-3:]):.0f} tokens (first and last 3 steps); wall time "
              f"fixed {fixed_s:.1f} s, adaptive {adapt_s:.1f} s ({fixed_s / adapt_s:.2f}x); "
              f"outside the steps {outside[0]:.1f} s and {outside[1]:.1f} s "
              f"({len(decisions)} decisions and the switch: {outside[1] - outside[0]:+.1f} s)")
        if switch is None:
            gains = ", ".join(f"{d['gain']:.2f}x" for d in decisions)
            print(f"  no switch: best predicted gains {gains}")
            continue
        k = switch["step"]
        later = range(k + 2, a.steps + 1)
        after_fixed = statistics.median(fixed[s - 1]["step_s"] for s in later)
        after_adapt = statistics.median(adapt[s - 1]["step_s"] for s in later)
        measured = after_fixed / after_adapt
        later_gain = _at_later_lengths(base / f"fixed_{i}", base / f"adaptive_{i}", switch,
                                       later)
        print(f"  switched at step {k}: {switch['plan']} -> {switch['best']}; "
              f"step time after it {after_fixed:.3f} s fixed, "
              f"{after_adapt:.3f} s adaptive: measured {measured:.2f}x, predicted "
              f"{switch['gain']:.2f}x at the window's lengths ({switch['gain'] / measured - 1:+.0%}"
              f"), {later_gain:.2f}x at the lengths generated after it "
              f"({later_gain / measured - 1:+.0%})")
    if a.out is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
