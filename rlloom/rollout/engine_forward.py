"""What the engine's forwards (rollout/engine.py) run with: caches that capture a prefill's
keys and values or write an extend's into one slot, the per-call fused decode weights, and a
prefill's result."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlloom.models.lora import LoRALinear
from rlloom.models.transformer import MLP
from rlloom.rollout.slot_cache import SlotKVCache


class Capture:
    """The cache a prefill forward runs with: keeps each layer's keys and values aside (to be
    copied into slots) and attends over them unchanged."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.kv.append((k, v))
        return k, v


class SlotWrite:
    """The cache an extend forward runs with: writes the new keys/values [1, kv, m, hd] into
    one slot from position `start` and attends over the slot's keys up to them."""

    def __init__(self, cache: SlotKVCache, slot: int, start: int) -> None:
        self.cache, self.slot, self.start = cache, slot, start

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.start + k.shape[2]
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slot, :, self.start:end] = k[0].to(kc.dtype)
        vc[self.slot, :, self.start:end] = v[0].to(vc.dtype)
        return kc[self.slot:self.slot + 1, :, :end], vc[self.slot:self.slot + 1, :, :end]


@dataclass
class FusedWeights:
    """One decoder layer's decode-time weights: q/k/v (and gate/up) stacked into one matmul
    each. Built per call, since training changes the weights between calls."""
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    split: tuple[int, int, int]   # q, k, v output widths
    gate_up_w: torch.Tensor | None  # None: call the layer's own MLP (e.g. an MoE block)
    gate_up_b: torch.Tensor | None

    @classmethod
    def of(cls, layer: nn.Module) -> "FusedWeights":
        a = layer.self_attn
        projs = (a.q_proj, a.k_proj, a.v_proj)
        qkv_b = (torch.cat([p.bias for p in projs]) if a.q_proj.bias is not None else None)
        split = tuple(p.weight.shape[0] for p in projs)
        gate_up_w = gate_up_b = None
        if isinstance(layer.mlp, MLP):
            m = layer.mlp
            gate_up_w = torch.cat([merged_weight(m.gate_proj), merged_weight(m.up_proj)])
            if m.gate_proj.bias is not None:
                gate_up_b = torch.cat([m.gate_proj.bias, m.up_proj.bias])
        return cls(torch.cat([merged_weight(p) for p in projs]), qkv_b, split, gate_up_w, gate_up_b)


def merged_weight(proj: nn.Linear) -> torch.Tensor:
    """What the projection multiplies by: a LoRA layer's merged weight (the fused copy is
    made per call anyway, so merging costs no extra memory that lasts)."""
    return proj.merged_weight() if isinstance(proj, LoRALinear) else proj.weight


@dataclass
class Prefilled:
    """One prefill forward: keys/values per layer [g, kv_heads, width, hd], last logits [g, V]."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    logits: torch.Tensor
