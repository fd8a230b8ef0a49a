"""rlloom on a GPU against the device's limits: ``python bench/gpu_roofline.py [--hw h200]``.

- decode: `engine_generate` on a randomly initialised model of a catalogue shape (default
  qwen2.5-0.5b) in bf16, B sequences of `--prompt` random tokens, exactly `--new` sampled
  tokens each (EOS off). A decode step's time is (time for `--new` tokens - time for 1) /
  (`--new` - 1), which leaves prefill out. Its roofline is the bytes one step must read
  (every weight it multiplies by once, the tied embedding as the logits matrix, plus the K/V
  of every live sequence up to its position) over the device's HBM bandwidth; the fraction
  reported is roofline time / measured time.
- training: forward + backward + AdamW of rlloom's model on B rows of `--train-len` tokens
  through the trainer's log-prob path. MFU = 6 N tokens / step time / peak bf16 (N = all
  parameters, the usual convention), and also against the performance model's FLOPs
  (3 x `ModelShape.forward_flops`, which adds attention and counts the logits matmul once).

The peak rates are the catalogue's datasheet numbers (`rlloom.perf.model.hardware`), picked from
the device name unless `--hw` names one. `--device cpu --model tiny --dtype float32` runs
the same code on a CPU, a smoke test of the script, not a measurement worth reading.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import ModelShape, model_shape
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.generate import Rollout
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import response_logprobs

sys.path.insert(0, str(Path(__file__).parent))
from generate import DTYPES, sync  # noqa: E402

NO_EOS = -1
# Longest name first: "H20" is a prefix of "H200".
DEVICE_NAMES = [("H200", "h200"), ("H100", "h100"), ("H20", "h20"), ("B200", "b200"),
                ("MI300X", "mi300x"), ("A100", "a100")]
TINY = ModelShape("tiny", 2, 128, 384, 4, 2, 32, 98, qkv_bias=False)


def guess_hw(device: torch.device) -> str:
    if device.type != "cuda":
        return "h200"
    name = torch.cuda.get_device_name(device)
    for key, hw in DEVICE_NAMES:
        if key in name.upper():
            if hw == "a100":
                big = torch.cuda.get_device_properties(device).total_memory > 50 * 2**30
                return "a100-80gb" if big else "a100-40gb"
            return hw
    print(f"unknown device {name!r}: comparing against h200; pass --hw")
    return "h200"


def build(shape: ModelShape, device: torch.device, dtype: torch.dtype, max_len: int
          ) -> CausalLM:
    if shape.moe:
        raise SystemExit(f"{shape.name} is an MoE shape; this script builds dense models")
    family = ("qwen2" if shape.qkv_bias else "llama" if shape.name.startswith("llama")
              else "qwen3")
    cfg = ModelConfig(family=family, vocab_size=shape.vocab,
                      hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_layers=shape.layers, num_heads=shape.heads,
                      num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      qkv_bias=shape.qkv_bias, qk_norm=family == "qwen3",
                      tie_word_embeddings=shape.tied_embeddings,
                      max_position_embeddings=max_len, rope_theta=1e6, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    model = CausalLM(cfg)
    model.init_weights(seed=0)
    return model.to(device=device, dtype=dtype)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def weight_bytes(model: CausalLM) -> int:
    """Bytes a decode step reads from the weights: all of them, except an untied input
    embedding, of which only the B looked-up rows are read."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        e = model.model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


def decode(model: CausalLM, shape: ModelShape, a: argparse.Namespace, hw, device) -> None:
    elem = next(model.parameters()).element_size()
    w_bytes = weight_bytes(model)
    print(f"\ndecode: {shape.name}, {w_bytes / 1e9:.2f} GB of weights read per step, "
          f"prompt {a.prompt} + {a.new} new tokens, {hw.name} HBM {hw.mem_bw / 1e12:.2f} TB/s")
    print(f"{'B':>5} {'step ms':>8} {'tok/s':>9} {'GB/step':>8} {'GB/s':>7} {'roofline':>9}")
    g = torch.Generator().manual_seed(0)
    for b in a.batches:
        prompts = torch.randint(3, shape.vocab, (b, a.prompt), generator=g).tolist()

        def run(new: int) -> None:
            engine_generate(model, prompts, SamplingParams(max_new_tokens=new, temperature=1.0),
                            NO_EOS, 0, torch.Generator().manual_seed(0))

        full, one = timed(lambda: run(a.new), device, a.repeats), timed(lambda: run(1), device,
                                                                         a.repeats)
        step = (full - one) / (a.new - 1)
        # the step that samples token i reads the K/V of prompt + i positions
        kv = b * shape.kv_bytes_per_token(elem) * (a.prompt + a.new / 2)
        nbytes = w_bytes + kv
        print(f"{b:>5} {step * 1e3:>8.3f} {b / step:>9.0f} {nbytes / 1e9:>8.3f} "
              f"{nbytes / step / 1e9:>7.0f} {nbytes / hw.mem_bw / step:>8.1%}")


def train(model: CausalLM, shape: ModelShape, a: argparse.Namespace, hw, device,
          dtype_name: str) -> None:
    g = torch.Generator().manual_seed(1)
    p_len, r_len = a.train_len // 8, a.train_len - a.train_len // 8
    rows = a.train_rows
    r = Rollout(torch.randint(3, shape.vocab, (rows, p_len), generator=g),
                torch.ones(rows, p_len, dtype=torch.long),
                torch.randint(3, shape.vocab, (rows, r_len), generator=g),
                torch.ones(rows, r_len, dtype=torch.long), torch.zeros(rows, r_len),
                torch.ones(rows, dtype=torch.bool))
    r = Rollout(*(t.to(device) for t in (r.prompt_ids, r.prompt_mask, r.response_ids,
                                         r.response_mask, r.logprobs, r.finished)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logp, _, _ = response_logprobs(model, r, 1.0)
        (-(logp * r.response_mask).sum() / r.response_mask.sum()).backward()
        opt.step()

    seconds = timed(step, device, a.repeats)
    tokens = rows * a.train_len
    peak = hw.peak_flops["bf16" if dtype_name == "bfloat16" else "fp32"]
    six_n = 6 * shape.params * tokens
    model_flops = 3 * shape.forward_flops(a.train_len) * tokens
    print(f"\ntraining: {shape.name} ({shape.params / 1e6:.1f}M params), {rows} x "
          f"{a.train_len} tokens, forward + backward + AdamW in {seconds * 1e3:.1f} ms = "
          f"{tokens / seconds:.0f} tok/s")
    print(f"  MFU (6 N tokens) {six_n / seconds / peak:.1%}, (perf model FLOPs) "
          f"{model_flops / seconds / peak:.1%} of {hw.name} {dtype_name} peak "
          f"{peak / 1e12:.0f} TFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b",
                    help="a rlloom.perf.model.shapes name, or tiny")
    ap.add_argument("--hw", default=None, help="rlloom.perf.model.hardware name; default from the "
                    "device name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256],
                    help="decode: sequences at once")
    ap.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="decode: new tokens")
    ap.add_argument("--train-rows", type=int, default=16)
    ap.add_argument("--train-len", type=int, default=1024, help="tokens per training row")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    device = torch.device(a.device)
    shape = TINY if a.model == "tiny" else model_shape(a.model)
    hw = hardware(a.hw or guess_hw(device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, compared with catalogue entry {hw.name}; torch {torch.__version__}")
    torch.manual_seed(0)
    model = build(shape, device, DTYPES[a.dtype],
                  max(a.prompt + a.new, a.train_len) + 16).eval()
    decode(model, shape, a, hw, device)
    train(model, shape, a, hw, device, a.dtype)


if __name__ == "__main__":
    main()
