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
from rlloom.models.moe import local
from rlloom.models.transformer import (MLP, CausalLM, apply_rotary, layer_masks, rope_kind,
                                       sink_softmax, softcap)
from rlloom.rollout.slot_cache import DTensor, SlotKVCache


def is_plain(model: nn.Module) -> bool:
    """Whether the engine's own decode drives the model: its attention is multi-head over
    key/value heads (latent attention decodes through its module, over its latents) and its
    modules run as written: no DTensor parameters and no module hooks (tensor parallelism,
    FSDP and `replicate` add both)."""
    if getattr(getattr(model, "config", None), "latent", False):
        return False
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


Projection = tuple[torch.Tensor, torch.Tensor | None]  # (weight, bias)


@dataclass
class FusedWeights:
    """One decoder layer's decode-time projections: on a CPU, q/k/v (and gate/up) stacked into
    one matmul each (copies built per call, since training changes the weights between
    calls: fewer operators to dispatch, which bound a CPU's decode); elsewhere the weights
    themselves (a GPU launches the extra matmuls in microseconds, and the copies would take
    over half the weights' memory while generation needs it for KV)."""
    qkv: tuple[Projection, ...]
    split: tuple[int, int, int]   # q, k, v output widths
    gate_up: tuple[Projection, ...] | None  # None: call the layer's own MLP (e.g. an MoE block)

    @classmethod
    def of(cls, layer: nn.Module) -> "FusedWeights":
        a = layer.self_attn
        projs = (a.q_proj, a.k_proj, a.v_proj)
        split = tuple(p.weight.shape[0] for p in projs)
        gate_up = None
        if isinstance(layer.mlp, MLP) and layer.mlp.gated:
            gate_up = _fused((layer.mlp.gate_proj, layer.mlp.up_proj))
        return cls(_fused(projs), split, gate_up)


def fuses(weight: torch.Tensor) -> bool:
    """Whether decode stacks the projections of weights on `weight`'s device (see
    `FusedWeights`)."""
    return weight.device.type == "cpu"


def _fused(projs: tuple[nn.Linear, ...]) -> tuple[Projection, ...]:
    parts = tuple((merged_weight(p), p.bias) for p in projs)
    if not fuses(parts[0][0]):
        return parts
    bias = torch.cat([b for _, b in parts]) if parts[0][1] is not None else None
    return ((torch.cat([w for w, _ in parts]), bias),)


def _project(x: torch.Tensor, parts: tuple[Projection, ...]) -> torch.Tensor:
    if len(parts) == 1:
        return F.linear(x, *parts[0])
    return torch.cat([F.linear(x, w, b) for w, b in parts], -1)


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
    q, k, v = _project(layer.attn_input(x), w.qkv).split(w.split, -1)
    heads = w.split[0] // hd
    q, k = attn.normed_qk(q.view(rows, heads, hd), k.view(rows, kv, hd))
    if attn.rotary:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    # the cache keeps the parameters' dtype; autocast may hand lower precision
    kc.view(-1, hd).index_copy_(0, index, k.reshape(rows * kv, hd).to(kc.dtype))
    vc.view(-1, hd).index_copy_(0, index, v.reshape(rows * kv, hd).to(vc.dtype))
    # query head h reads kv head h // (heads / kv), as repeat_kv and SDPA's GQA do; the first
    # `width` positions of each (slot, kv head) are a strided view, not a copy
    keys = kc.view(rows * kv, cap, hd)[:, :width]
    if attn.softcap is None:
        scores = torch.baddbmm(bias, q.reshape(rows * kv, heads // kv, hd), keys.transpose(1, 2),
                               alpha=attn.scale)
    else:  # capped before the mask, as the training pass does
        scores = softcap(torch.bmm(q.reshape(rows * kv, heads // kv, hd), keys.transpose(1, 2))
                         * attn.scale, attn.softcap) + bias
    sinks = local(attn.sinks)  # query head h's row of this [rows * kv, heads / kv] grid
    probs = sink_softmax(scores, None if sinks is None else sinks.view(kv, -1).repeat(rows, 1)
                         ).to(x.dtype)
    out = torch.bmm(probs, vc.view(rows * kv, cap, hd)[:, :width]).view(rows, heads * hd)
    x = layer.attn_output(x, attn.o_proj(out))
    h = layer.mlp_input(x)
    if w.gate_up is None:
        return layer.mlp_output(x, layer.mlp(h[:, None])[:, 0])
    gate, up = _project(h, w.gate_up).chunk(2, -1)
    return layer.mlp_output(x, layer.mlp.down_proj(layer.mlp.act(gate) * up))


def prefill_forward(model: CausalLM, ids: torch.Tensor, plen: torch.Tensor,
                    ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> Prefilled:
    """One prefill forward of right-padded prompts `ids` [b, width] of lengths `plen`, rotary
    tables `ropes` (cos, sin [positions, head_dim] of each `rope_kind`): each layer's keys
    and values and the last real position's logits."""
    b, width = ids.shape
    # right padding: a real query's keys (itself and before) are all real, so causal
    # attention needs no mask tensor (fused kernels, grouped KV heads as they are) but on
    # sliding-window layers; a padded query's output is never read, and the decode steps
    # hide its cached keys
    masks: list[torch.Tensor | None] = [None] * model.config.num_layers
    if model.config.sliding_window is not None:
        pos = torch.arange(width, device=ids.device)
        masks = layer_masks(model.config, (pos[None] <= pos[:, None])[None, None], 0)
    ropes = [(cos[:width].view(1, 1, width, -1), sin[:width].view(1, 1, width, -1))
             for cos, sin in ropes]
    backbone, capture = model.model, Capture()
    x = backbone.embed_tokens(ids, torch.arange(width, device=ids.device)[None])
    for i, layer in enumerate(backbone.layers):
        x = layer(x, *ropes[rope_kind(model.config, i)], masks[i], capture, i)
    last = x[torch.arange(b, device=ids.device), plen - 1]
    return Prefilled([k for k, _ in capture.kv], [v for _, v in capture.kv],
                     model.lm_head(backbone.norm(last)))


def decode_forward(model: CausalLM, fused: list[FusedWeights], cache: SlotKVCache,
                   tokens: torch.Tensor, lens: torch.Tensor, held: torch.Tensor, width: int,
                   ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One decode step of the first `rows` slots (`tokens`, `lens`, `held`: [rows]), reading
    `width` key positions; the new keys and values go into `cache`; logits [rows, V]."""
    rows, cap = len(tokens), cache.cap
    backbone, c, kv = model.model, model.config, cache.kv_heads
    x = backbone.embed_tokens(tokens, lens)                               # [rows, hidden]
    ropes = [(cos[lens][:, None], sin[lens][:, None]) for cos, sin in ropes]  # [rows, 1, hd]
    # computed once per step for every layer: the additive mask over the key positions the
    # step reads (up to the widest held context, not the cache's whole capacity: a long
    # rollout that has ended costs the others nothing) and the new key's index
    pos = torch.arange(width, device=tokens.device)
    hidden = pos > lens[:, None]                                          # [rows, width]
    biases = [decode_bias(hidden, kv, cache.dtype)] * c.num_layers
    if c.sliding_window is not None:  # the new token is at index lens
        window = decode_bias(hidden | (pos <= lens[:, None] - c.sliding_window), kv,
                             cache.dtype)
        biases = [window if c.layer_window(i) else b for i, b in enumerate(biases)]
    # row (slot, kv head) of the flattened cache, times its capacity, plus the position; a
    # free slot (decoded along, output ignored) writes at its own position 0, since its stale
    # length may equal the capacity and would spill into the next slot; a parked one at its
    # length, which its extend overwrites
    index = torch.arange(rows * kv, device=tokens.device) * cap \
        + (lens * held).repeat_interleave(kv)
    for i, (layer, w) in enumerate(zip(backbone.layers, fused)):
        x = decode_layer(layer, w, x, *ropes[rope_kind(c, i)], biases[i], index,
                         cache.k[i][:rows], cache.v[i][:rows])
    return model.lm_head(backbone.norm(x))
