"""What the engine's forwards (rollout/engine.py) run with: which prompts share a prefill,
whether the model's modules can be driven as written, caches that capture a prefill's keys
and values or write an extend's into one slot, the per-call fused decode weights, a
prefill's result, one decoder layer of a decode step over the slot cache, and the tokens
the forwards ran."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlloom.models.lora import LoRALinear
from rlloom.models.transformer import MLP, apply_rotary
from rlloom.rollout.slot_cache import SlotKVCache

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support has no DTensor parameters
    DTensor = ()


def is_plain(model: nn.Module) -> bool:
    """Whether the model's modules run as written: no DTensor parameters and no module hooks
    (tensor parallelism, FSDP and `replicate` add both)."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False
    return not any(isinstance(p, DTensor) for p in model.parameters())


@dataclass
class Forwarded:
    """Tokens one `Engine.generate` call ran through the model: prompt tokens prefilled
    (once per distinct prompt), tokens extended onto a parked slot (a call's last token and
    its result), and decode-step rows (live rows times steps)."""
    prefill: int = 0
    extend: int = 0
    decode: int = 0


def prompt_groups(prompts: list[list[int]], n_samples: int = 0) -> list[int]:
    """Group index of each prompt: runs of equal consecutive prompts share one, or fixed runs
    of `n_samples` when given (checked to be equal)."""
    if n_samples:
        if len(prompts) % n_samples:
            raise ValueError(f"{len(prompts)} prompts are not whole groups of n_samples="
                             f"{n_samples}")
        for i, p in enumerate(prompts):
            if p != prompts[i - i % n_samples]:
                raise ValueError(f"prompt {i} differs from the first of its group of "
                                 f"{n_samples}; pass n_samples=0 to detect groups")
        return [i // n_samples for i in range(len(prompts))]
    out, g = [], -1
    for i, p in enumerate(prompts):
        if i == 0 or p != prompts[i - 1]:
            g += 1
        out.append(g)
    return out


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


def decode_bias(hidden: torch.Tensor, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [rows * kv, 1, width] hiding the keys `hidden` [rows, width]
    marks."""
    rows, width = hidden.shape
    bias = torch.zeros(rows, 1, 1, width, dtype=dtype, device=hidden.device)
    bias.masked_fill_(hidden.view(rows, 1, 1, width), float("-inf"))
    return bias.expand(rows, kv, 1, width).reshape(rows * kv, 1, width)


def decode_layer(layer: nn.Module, w: FusedWeights, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, bias: torch.Tensor, index: torch.Tensor, kc: torch.Tensor,
                 vc: torch.Tensor) -> torch.Tensor:
    """One decoder layer for one new token per row, x [rows, hidden]: the model's math (its
    norms, rotary, GQA head order, MLP) with fused projections; the new keys and values are
    written into the rows' slot caches `kc`, `vc` [rows, kv, cap, hd] at flat `index`, and
    attention reads the first `bias.shape[-1]` positions of each."""
    rows, kv, cap, hd = kc.shape
    width = bias.shape[-1]
    attn = layer.self_attn
    q, k, v = F.linear(layer.input_layernorm(x), w.qkv_w, w.qkv_b).split(w.split, -1)
    heads = w.split[0] // hd
    q, k = q.view(rows, heads, hd), k.view(rows, kv, hd)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # the cache keeps the parameters' dtype; autocast may hand lower precision
    kc.view(-1, hd).index_copy_(0, index, k.reshape(rows * kv, hd).to(kc.dtype))
    vc.view(-1, hd).index_copy_(0, index, v.reshape(rows * kv, hd).to(vc.dtype))
    # query head h reads kv head h // (heads / kv), as repeat_kv and SDPA's GQA do; the first
    # `width` positions of each (slot, kv head) are a strided view, not a copy
    keys = kc.view(rows * kv, cap, hd)[:, :width]
    scores = torch.baddbmm(bias, q.view(rows * kv, heads // kv, hd), keys.transpose(1, 2),
                           alpha=hd ** -0.5)
    probs = scores.softmax(-1, dtype=torch.float32).to(x.dtype)
    out = torch.bmm(probs, vc.view(rows * kv, cap, hd)[:, :width]).view(rows, heads * hd)
    x = x + attn.o_proj(out)
    h = layer.post_attention_layernorm(x)
    if w.gate_up_w is None:
        return x + layer.mlp(h[:, None])[:, 0]
    gate, up = F.linear(h, w.gate_up_w, w.gate_up_b).chunk(2, -1)
    return x + layer.mlp.down_proj(layer.mlp.act(gate) * up)
