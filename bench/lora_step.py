"""LoRA against full training, side by side on this machine: ``python bench/lora_step.py``.

Times one optimizer step (forward, backward, AdamW) of the same decoder on the same batch,
alternating full and LoRA steps so both see the same machine load, and counts optimizer
state. The cost model prices LoRA's backward at 2 C_f against 3 C_f (no weight gradients
for the frozen base), i.e. a training step at about 2/3 of the time where compute binds.
"""
from __future__ import annotations

import statistics
import time

import torch

from rlloom.models.config import ModelConfig
from rlloom.models.lora import PROJECTIONS, apply_lora
from rlloom.models.transformer import CausalLM

CFG = ModelConfig(family="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768,
                  num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True)
BATCH, SEQ, REPS = 8, 128, 8


def _model(lora: bool) -> tuple[CausalLM, torch.optim.Optimizer]:
    model = CausalLM(CFG)
    model.init_weights(seed=0)
    if lora:
        apply_lora(model, rank=16, alpha=32.0, dropout=0.0, targets=PROJECTIONS, seed=0)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optim


def _step(model: CausalLM, optim: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                             ids[:, 1:].flatten())
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    return time.perf_counter() - start


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optim.state.values()
               for t in s.values() if torch.is_tensor(t))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    ids = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1))
    runs = {name: _model(name == "lora") for name in ("full", "lora")}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, (model, optim) in runs.items():  # warm-up, and optimizer state allocated
        _step(model, optim, ids)
    for _ in range(REPS):
        for name, (model, optim) in runs.items():
            times[name].append(_step(model, optim, ids))
    full, lora = (statistics.median(times[n]) for n in ("full", "lora"))
    state = {n: _state_bytes(o) for n, (_, o) in runs.items()}
    print(f"step (forward + backward + AdamW), median of {REPS}, {BATCH}x{SEQ} tokens: "
          f"full {full * 1e3:.1f} ms, LoRA r=16 {lora * 1e3:.1f} ms, ratio {lora / full:.2f} "
          "(priced: 0.67 where compute binds)")
    print(f"optimizer state: full {state['full'] / 2**20:.1f} MiB, LoRA "
          f"{state['lora'] / 2**20:.2f} MiB, ratio {state['lora'] / state['full']:.3f}")


if __name__ == "__main__":
    main()
