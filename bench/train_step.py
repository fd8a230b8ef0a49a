"""Training forward+backward throughput, rlloom against the transformers model with the same
weights on the same batch and the same loss:
``python bench/train_step.py [--big] [--device cuda]``.

The batch is what a step trains on: B prompts x K samples, prompts of 16-47 tokens and
long-tailed response lengths (exponential, mean `--mean-len`, capped at `--max-len`), in
generation's layout (left-padded prompts, right-padded responses). The loss is minus the mean
log-prob of the response tokens at temperature 1, the core of every policy loss.

- transformers: one padded forward+backward (positions from the mask, as rlloom computes
  them, so both see the same inputs and give the same loss);
- rlloom, padded: the same single padded forward+backward through rlloom's model;
- rlloom, bucketed: rows sorted by length and cut into micro-batches of at most
  `--budget` padded tokens, each trimmed to its own widths, gradients accumulated (what
  the trainer does under torchrun, and for value heads);
- rlloom, shared: each distinct prompt once, then the responses in buckets attending to it,
  and one backward through the prompt pass (what `runtime.stages.online.optimise` does).
tok/s counts real (unpadded) prompt + response tokens of the K rows. On a GPU (`--device
cuda`, default dtype bfloat16 there) timings wait for the device, and the four losses agree
to bf16 rounding instead of 1e-4.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlloom.config import load_config
from rlloom.models.hf_io import save_checkpoint
from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.runtime.stages.batch import response_logprobs
from rlloom.runtime.stages.packing import micro_batches, trim
from rlloom.runtime.stages.shared_prompt import SharedPrompts

sys.path.insert(0, str(Path(__file__).parent))
from generate import (  # noqa: E402
    VOCAB,
    add_machine_args,
    machine,
    prompts_for,
    shape,
    time_best,
)


def batch(b: int, k: int, mean_len: float, max_len: int, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompts = [p for p in prompts_for(b, seed) for _ in range(k)]
    lens = (torch.empty(b * k).exponential_(1 / mean_len, generator=g).long() + 1).clamp(
        max=max_len)
    p_ids, p_mask = left_pad(prompts, 0)
    r_ids, r_mask = right_pad([torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
                               for n in lens], 0)
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(r_ids.shape),
                   torch.ones(b * k, dtype=torch.bool))


def rlloom_step(model: CausalLM, r: Rollout, budget: int | None, share: bool = False) -> float:
    model.zero_grad(set_to_none=True)
    total = r.response_mask.sum()
    parts = ([torch.arange(len(r.finished))] if budget is None else
             micro_batches(r.prompt_mask.sum(1), r.response_mask.sum(1), budget, share))
    prompts = SharedPrompts(model, r, train=True) if share else None
    loss_sum = 0.0
    for part in parts:
        mb = r.select(part) if budget is None else trim(r.select(part))
        logp, _, _ = response_logprobs(model, mb, 1.0, prompts=prompts, rows=part)
        loss = -(logp * mb.response_mask).sum() / total
        loss.backward()
        loss_sum += loss.item()
    if prompts is not None:
        prompts.backward()
    return loss_sum


def hf_step(hf: torch.nn.Module, r: Rollout) -> float:
    hf.zero_grad(set_to_none=True)
    ids = torch.cat([r.prompt_ids, r.response_ids], 1)
    mask = torch.cat([r.prompt_mask, r.response_mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    p, t = r.prompt_ids.shape[1], r.response_ids.shape[1]
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, p - 1:p + t - 1].float(), -1)
    logp = logp.gather(-1, r.response_ids[..., None]).squeeze(-1)
    loss = -(logp * r.response_mask).sum() / r.response_mask.sum()
    loss.backward()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--b", type=int, default=16, help="prompts")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt")
    ap.add_argument("--mean-len", type=float, default=48.0, help="mean response length")
    ap.add_argument("--max-len", type=int, default=256, help="response length cap")
    ap.add_argument("--budget", type=int, default=load_config(None, []).train.micro_batch_tokens,
                    help="padded tokens per micro-batch (bucketed run; train.micro_batch_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    add_machine_args(ap)
    a = ap.parse_args()
    device, dtype, label = machine(a)
    r = batch(a.b, a.k, a.mean_len, a.max_len).to(device)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    real = int(r.prompt_mask.sum() + r.response_mask.sum())
    padded = r.prompt_ids.numel() + r.response_ids.numel()
    rows = []
    for hidden, layers in [(128, 2)] + ([(512, 4)] if a.big else []):
        model = CausalLM(shape(hidden, layers))
        model.init_weights(seed=0)
        with tempfile.TemporaryDirectory() as d:
            save_checkpoint(model, None, d)
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device)
        model.to(device=device, dtype=dtype)
        hf.train()
        runs = {"hf": lambda: hf_step(hf, r), "padded": lambda: rlloom_step(model, r, None),
                "bucketed": lambda: rlloom_step(model, r, a.budget),
                "shared": lambda: rlloom_step(model, r, a.budget, share=True)}
        losses = {k: fn() for k, fn in runs.items()}
        spread = max(losses.values()) - min(losses.values())
        assert spread < tolerance, f"the four runs must compute the same loss: {losses}"
        times = time_best(runs, a.repeats, device)
        print(f"h{hidden}xL{layers} loss: " +
              ", ".join(f"{k} {v:.9f}" for k, v in losses.items()), flush=True)
        for clock in (0, 1):
            tps = {k: real / v[clock] for k, v in times.items()}
            rows.append((f"h{hidden}xL{layers}", ("wall", "cpu")[clock], tps, spread))
    print(f"\ntrain step (forward+backward), {a.b}x{a.k} rows, {real} real tokens in a "
          f"{padded}-token padded batch, budget {a.budget}, {label}, "
          f"best of {a.repeats}")
    ours = ("padded", "bucketed", "shared")
    print(f"{'model':>10} {'clock':>5} {'HF tok/s':>9} " + " ".join(f"{k:>9}" for k in ours)
          + " " + " ".join(f"{k + '/HF':>12}" for k in ours) + f" {'loss diff':>10}")
    for name, clock, tps, spread in rows:
        print(f"{name:>10} {clock:>5} {tps['hf']:>9.0f} "
              + " ".join(f"{tps[k]:>9.0f}" for k in ours) + " "
              + " ".join(f"{tps[k] / tps['hf']:>11.2f}x" for k in ours) + f" {spread:>10.1e}")


if __name__ == "__main__":
    main()
