"""Generation throughput, rlloom's engine against transformers' `generate` on the same weights:
``python bench/generate.py [--batches 16 64] [--k 8] [--new 128] [--big] [--device cuda]``.

Both sample B prompts x K samples at temperature 1 (no top-k / top-p) for exactly `--new`
tokens: EOS stopping is off in both, so they do the same work. transformers gets the K
samples through `num_return_sequences` (its usual way); rlloom gets the prompts repeated K
times, as the trainer passes them. tok/s counts generated tokens over wall time including
prefill. The reference `rlloom.rollout.generate` is timed too (`--reference`). On a GPU
(`--device cuda`, default dtype bfloat16 there) timings wait for the device to finish.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from rlloom.models.config import ModelConfig
from rlloom.models.hf_io import save_checkpoint
from rlloom.models.transformer import CausalLM
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.generate import generate, left_pad
from rlloom.rollout.sampling import SamplingParams

VOCAB = 98  # the built-in char tokenizer's size
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
NO_EOS = -1


def shape(hidden: int, layers: int) -> ModelConfig:
    """The built-in model's shape (runtime/default_model.py) at a given width and depth."""
    heads = max(4, hidden // 32)
    return ModelConfig(family="qwen3", vocab_size=VOCAB, hidden_size=hidden,
                       intermediate_size=3 * hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=heads // 2, head_dim=hidden // heads, qk_norm=True,
                       max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def prompts_for(b: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 48, (b,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def add_machine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--big", action="store_true", help="also hidden 512, 4 layers")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="of weights, activations and KV cache; default float32 on cpu, "
                    "bfloat16 on cuda")


def machine(a: argparse.Namespace) -> tuple[torch.device, torch.dtype, str]:
    """Device, dtype and a label for the report, with the thread count applied."""
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype or ("float32" if device.type == "cpu" else "bfloat16")]
    where = f"{a.threads} CPU thread(s)" if device.type == "cpu" else str(device)
    return device, dtype, f"{dtype}, {where}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_best(fns: dict[str, Callable[[], object]], repeats: int,
              device: torch.device = torch.device("cpu")) -> dict[str, tuple[float, float]]:
    """Fastest wall and CPU seconds of each function over `repeats` rounds, after a warm-up.

    The functions take turns within each round, so a burst of load from other jobs on a
    shared machine hits all of them alike; the minimum, since noise only adds. CPU seconds
    (this process, all threads) are reported too: wall time also counts waiting for a core.
    """
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def run_rlloom(model: CausalLM, prompts: list[list[int]], k: int, new: int) -> None:
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    out = engine_generate(model, [p for p in prompts for _ in range(k)], params, NO_EOS, 0,
                          torch.Generator().manual_seed(0))
    assert int(out.response_mask.sum()) == len(prompts) * k * new


def run_reference(model: CausalLM, prompts: list[list[int]], k: int, new: int) -> None:
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    generate(model, [p for p in prompts for _ in range(k)], params, NO_EOS, 0,
             torch.Generator().manual_seed(0))


def run_hf(hf: torch.nn.Module, prompts: list[list[int]], k: int, new: int) -> None:
    ids, mask = (t.to(hf.device) for t in left_pad(prompts, 0))
    torch.manual_seed(0)
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                      top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new,
                      num_return_sequences=k, eos_token_id=None, pad_token_id=0)
    assert out.shape == (len(prompts) * k, ids.shape[1] + new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64], help="prompts per call")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--new", type=int, default=128, help="new tokens per sample")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="also rlloom's reference")
    add_machine_args(ap)
    a = ap.parse_args()
    device, dtype, label = machine(a)
    shapes = [(128, 2)] + ([(512, 4)] if a.big else [])
    rows = []
    for hidden, layers in shapes:
        model = CausalLM(shape(hidden, layers))
        model.init_weights(seed=0)
        model.eval()
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(model, None, d)
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).eval().to(device)
        model.to(device=device, dtype=dtype)
        for b in a.batches:
            prompts = prompts_for(b)
            tokens = b * a.k * a.new
            fns = {"hf": lambda: run_hf(hf, prompts, a.k, a.new),
                   "rlloom": lambda: run_rlloom(model, prompts, a.k, a.new)}
            if a.reference:
                fns["reference"] = lambda: run_reference(model, prompts, a.k, a.new)
            times = time_best(fns, a.repeats, device)
            hf_s, ours_s = times["hf"], times["rlloom"]
            ref_s = times.get("reference", (float("nan"), float("nan")))
            for clock in (0, 1):
                rows.append((f"h{hidden}xL{layers}", b, ("wall", "cpu")[clock],
                             tokens / ours_s[clock], tokens / hf_s[clock],
                             tokens / ref_s[clock], hf_s[clock] / ours_s[clock]))
            print(f"  done h={hidden} L={layers} B={b}", flush=True)
    print(f"\ngeneration, K={a.k}, {a.new} new tokens, temperature 1, {label}, "
          f"best of {a.repeats}; tok/s = generated tokens / seconds")
    print(f"{'model':>10} {'B':>4} {'clock':>5} {'rlloom tok/s':>13} {'HF tok/s':>10} "
          f"{'reference':>10} {'rlloom/HF':>10}")
    for name, b, clock, ours, hf_tps, ref, ratio in rows:
        print(f"{name:>10} {b:>4} {clock:>5} {ours:>13.0f} {hf_tps:>10.0f} {ref:>10.0f} "
              f"{ratio:>9.2f}x")


if __name__ == "__main__":
    main()
