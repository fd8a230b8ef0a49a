"""Generation with continuous batching at several slot counts, measured on rlloom's engine
next to the cost model's price of the same rollouts:
``python bench/generation.py [--prompts 32] [--samples 4] [--slots 0 32 8 2]``.

One process, one thread. The model is the long-tail bench model of `bench/schedules.py`
(arith with a difficulty mixture, warm-started on worked solutions), so a few responses are
ten times the median. For each slot count (`rollout.max_batch`; 0 = every rollout at once)
the engine generates the same prompts with the same seed, so the lengths are the same
whatever the slots; the script prints the engine's decode steps and seconds (best of
`--repeats`) beside `cost.generation`'s steps and seconds for those lengths, with this
machine's hardware file (`rlloom bench hw`, optionally calibrated), and the ratios to the
all-at-once run, which is what the model must get right to choose a slot count.
"""
from __future__ import annotations

import argparse
import time

import torch

from rlloom.config import load_config
from rlloom.data.synthetic import generate
from rlloom.models.hf_io import load_model, load_tokenizer
from rlloom.perf.model import cost, engine_schedule
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout
from rlloom.rollout import engine as engine_module
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.stages.batch import encode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--slots", type=int, nargs="+", default=[0, 32, 8, 2])
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.hidden_size=64", "model.layers=2", "model.heads=2",
                             "model.kv_heads=1", "data.difficulty={1: 0.94, 16: 0.06}",
                             "data.train_size=400", "sft.steps=200", "sft.batch_size=16",
                             "sft.direct_fraction=0"])
    path = ensure_default_model(cfg, torch.device("cpu"))
    model, tok = load_model(path, torch.float32).eval(), load_tokenizer(path)
    problems = generate("arith", a.prompts, seed=7, difficulty=cfg.data.difficulty)
    prompts = [ids for ids in encode(tok, [p.prompt for p in problems])
               for _ in range(a.samples)]
    params = SamplingParams(max_new_tokens=a.max_new, temperature=1.0)
    shape, hw = model_shape(str(path)), hardware("local")
    steps = {"n": 0}
    decode = engine_module._Run._decode_step

    def counted(run: engine_module._Run) -> None:
        steps["n"] += 1
        decode(run)
    engine_module._Run._decode_step = counted  # type: ignore[method-assign]
    rows = []
    for slots in a.slots:
        best = float("inf")
        for _ in range(a.repeats):
            steps["n"] = 0
            t0 = time.perf_counter()
            out = engine_generate(model, prompts, params, tok.eos_token_id, tok.pad_token_id,
                                  torch.Generator().manual_seed(0),
                                  EngineConfig(max_batch=slots, n_samples=a.samples))
            best = min(best, time.perf_counter() - t0)
        lengths = out.response_lengths.tolist()
        wl = Workload(a.prompts, a.samples, round(sum(map(len, prompts)) / len(prompts)),
                      Lengths.empirical(lengths), dtype="fp32", max_batch=slots)
        priced = cost.generation(shape, Layout(), wl, hw, hw.mem_bytes)  # KV fits: a CPU
        sched = engine_schedule.engine_schedule(engine_schedule.queue_lengths(wl, len(prompts)),
                                     slots or len(prompts), a.samples)
        rows.append((slots or len(prompts), steps["n"], best, sched.decode_steps,
                     priced.seconds))
    ordered = sorted(lengths)
    print(f"{len(prompts)} rollouts; response lengths p50 {ordered[len(ordered) // 2]}, p99 "
          f"{ordered[int(0.99 * (len(ordered) - 1))]}, max {ordered[-1]}; hardware {hw.name}")
    print(f"{'slots':>6}{'steps':>8}{'measured s':>12}{'priced steps':>14}{'predicted s':>13}"
          f"{'measured x':>12}{'predicted x':>13}")
    base_m, base_p = rows[0][2], rows[0][4]
    for slots, n, m, pn, p in rows:
        print(f"{slots:>6}{n:>8}{m:>12.3f}{pn:>14}{p:>13.3f}{m / base_m:>12.2f}"
              f"{p / base_p:>13.2f}")


if __name__ == "__main__":
    main()
