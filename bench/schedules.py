"""Schedules on Ray with long-tailed response lengths, measured next to the performance model:
``python bench/schedules.py [--steps 8] [--max-new 128] [--temperature 1.3] [--cpus 2]``.

One task setting (the built-in arith task on a tiny, barely warm-started model sampled hot, so
response lengths spread from a few tokens to the cap), run four ways with the same total CPUs
given to Ray: sync colocated (one group with all CPUs), and sync, fused and async (eta=1)
disaggregated (generation gets half the CPUs, training and the reference a quarter each).

Step time is the simulator's definition, the interval between the ends of consecutive
training spans (trace.json) after the warm-up steps (their median), so driver overhead
between steps counts alike for every schedule and an async pipeline's overlap shows.
Predicted ratios come from `rlloom.perf.compose.price` with the workload built from the
lengths the colocated run generated (`Lengths.empirical`) and this machine's hardware file
(`rlloom bench hw`). The model gives every group its own device, while here the groups share
the machine's cores (and any other load on it), so overlapping schedules gain less than
predicted when cores are short.
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
from rlloom.perf.compose import price, role_models
from rlloom.perf.shapes import ModelShape
from rlloom.perf.validate import run_roles
from rlloom.perf.workload import Lengths, Workload
from rlloom.plan import Layout, Plan
from rlloom.runtime.ray_plan import RayOptions
from rlloom.runtime.ray_runtime import train_ray

WARMUP = 2
CONFIGS = {  # name -> (placement, schedule, staleness)
    "sync colocated": ("colocated", "sync", 0),
    "sync disaggregated": ("disaggregated", "sync", 0),
    "fused disaggregated": ("disaggregated", "fused", 0),
    "async eta=1 disaggregated": ("disaggregated", "async", 1),
}


def step_interval(run: Path, warmup: int) -> float:
    """Median interval between consecutive training ends after `warmup` steps (the median:
    other jobs on a shared machine add spikes)."""
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    ends = sorted((e["args"]["step"], (e["ts"] + e["dur"]) / 1e6) for e in events
                  if e["name"] == "training")
    ends = [t for step, t in ends if step >= warmup]
    return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def predicted(run: Path, cfg_overrides: list[str]) -> dict[str, float] | None:
    from rlloom.perf.hardware import hardware
    try:
        hw = hardware("local")
    except KeyError as e:
        print(f"no predicted column: {e.args[0]}")
        return None
    cfg = load_config(None, cfg_overrides)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lengths = [n for r in rows for n in r["response_lens"]]
    shape = ModelShape.from_hf_config(json.loads((run / "final" / "config.json").read_text()))
    rollouts = len(rows[0]["response_lens"])
    wl = Workload(prompts=rollouts // cfg.rollout.n_samples, samples=cfg.rollout.n_samples,
                  prompt_len=round(statistics.mean(r["prompt_len"] for r in rows)),
                  response=Lengths.empirical(lengths), ppo_epochs=cfg.algo.epochs,
                  minibatches=cfg.algo.minibatches,
                  micro_batch=-(-rollouts // cfg.algo.minibatches), dtype="fp32")
    models = role_models(shape, run_roles(cfg))
    out = {}
    for name, (placement, schedule, eta) in CONFIGS.items():
        plan = Plan(placement=placement, schedule=schedule, staleness=eta)
        # the Ray runtime gives generation of a disaggregated plan its own group
        gen = Layout() if placement == "disaggregated" else None
        out[name] = price(plan, models, wl, hw, gen_layout=gen).step_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128, help="rollout.max_new_tokens")
    ap.add_argument("--temperature", type=float, default=1.3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--cpus", type=float, default=2.0, help="total CPUs given to Ray")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp dir)")
    a = ap.parse_args()
    import ray
    base = Path(a.out or tempfile.mkdtemp(prefix="rlloom-bench-"))
    temp = tempfile.mkdtemp(prefix="rlb-", dir="/tmp")
    ray.init(num_cpus=a.cpus, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    overrides = ["model.hidden_size=64", "model.layers=2", "model.heads=2", "model.kv_heads=1",
                 "data.difficulty=1", "data.train_size=200", "data.eval_size=16",
                 "sft.steps=20", "sft.batch_size=16", f"train.steps={a.steps}",
                 f"train.prompts_per_step={a.prompts}", f"rollout.n_samples={a.samples}",
                 f"rollout.max_new_tokens={a.max_new}", f"rollout.temperature={a.temperature}",
                 "eval.max_new_tokens=16", "eval.every=1000", "checkpoint.every=1000",
                 "train.threads=1"]
    half, quarter = a.cpus / 2, a.cpus / 4
    measured: dict[str, float] = {}
    try:
        for name, (placement, schedule, eta) in CONFIGS.items():
            run = base / name.replace(" ", "_").replace("=", "")
            shutil.rmtree(run, ignore_errors=True)
            cpus = ({"all": a.cpus} if placement == "colocated" else
                    {"rollout": half, "actor": quarter, "reference": quarter})
            cfg = load_config(None, [*overrides, f"run_dir={run}",
                                     f"plan.placement={placement}",
                                     f"plan.schedule={schedule}", f"plan.staleness={eta}"])
            t0 = time.perf_counter()
            train_ray(cfg, None, RayOptions(worker_timeout_s=300, group_cpus=cpus))
            measured[name] = step_interval(run, WARMUP + 1)
            print(f"{name}: {measured[name]:.3f} s/step ({time.perf_counter() - t0:.0f}s "
                  "with start-up)", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    first = base / "sync_colocated"
    pred = predicted(first, [*overrides, f"run_dir={first}"])
    lens = sorted(n for line in (first / "metrics.jsonl").read_text().splitlines()
                  for n in json.loads(line)["response_lens"])
    q = [lens[int(p * (len(lens) - 1))] for p in (0.1, 0.5, 0.9, 1.0)]
    print(f"\nresponse lengths (sync colocated run): p10 {q[0]}, p50 {q[1]}, p90 {q[2]}, "
          f"max {q[3]} of {a.max_new}; {a.prompts}x{a.samples} rollouts/step, "
          f"{a.cpus:g} CPUs in all (os.cpu_count()={os.cpu_count()})")
    print(f"step time after {WARMUP} warm-up steps, as a ratio to sync colocated")
    print(f"{'schedule':<28}{'measured s':>11}{'ratio':>8}{'predicted s':>13}{'ratio':>8}")
    ref = measured["sync colocated"]
    for name, s in measured.items():
        line = f"{name:<28}{s:>11.3f}{s / ref:>8.2f}"
        if pred:
            line += f"{pred[name]:>13.4f}{pred[name] / pred['sync colocated']:>8.2f}"
        print(line)
    if a.out is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
