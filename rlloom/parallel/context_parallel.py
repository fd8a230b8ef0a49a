"""Context parallelism: the sequence dimension sharded over the ranks of a cp group.

Rows are packed first (`packed_order`: each row's real tokens first, its padding after), and
rank r holds the contiguous positions [r * s / cp, (r + 1) * s / cp) of every packed row.
Everything but attention is position-wise and runs on the shard as is. Attention all-gathers
keys and values along the sequence and each rank's queries attend to the keys up to their
own: causal aligned to the last key, which fused kernels run without a mask tensor. Rotary embeddings use the tokens' packed positions
(rotated before the gather, so the gathered keys are already correct). The gather's
backward is a reduce-scatter (done as an all-to-all plus a sum, which gloo supports), so
key/value gradients from every rank's queries return to the rank that owns those
positions. `on_shards` gathers the outputs and puts them back in the rows' token order.

Why all-gather and not ring attention: ring attention passes K/V blocks between neighbours
while computing, keeping K/V memory per rank at s / cp and overlapping communication, but it
needs blockwise attention with log-sum-exp merging and a hand-written backward. The
all-gather is the simplest scheme that is exactly the single-process computation: its cost is
full-length K/V per rank per layer (kept for backward), and with gloo on CPU there is no
overlap to gain. Contiguous shards also leave the causal work unbalanced (the last rank's
queries see the most keys); a zig-zag assignment would balance it.

The model code is not touched: `apply_context_parallel` swaps the backbone for a wrapper that
packs, computes positions and masks, and hands each layer a key/value gatherer in the slot
that attention uses for its KV cache (`cache.update(layer, k, v)` returns the keys and values
to attend to). Parameter gradients are each rank's partial sums: all-reduce (sum) them over
the cp group, as data parallelism does over dp, with a loss normalised over the whole
sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.models.transformer import (packed_order, packed_positions, rope_kind, rope_tables,
                                       unpack)


class _GatherSeq(torch.autograd.Function):
    """All-gather along `dim`; backward sums every rank's gradient of our shard."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None
                ) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        world = dist.get_world_size(ctx.group)
        # Reduce-scatter as all-to-all: chunk j of every rank's gradient goes to rank j.
        send = grad.movedim(ctx.dim, 0).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=ctx.group)
        shard = recv.view(world, send.shape[0] // world, *send.shape[1:]).sum(0)
        return shard.movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
                    ) -> torch.Tensor:
    """Differentiable all-gather of equal shards along `dim`, in rank order."""
    return _GatherSeq.apply(x, dim, group)


def shard_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
                   ) -> torch.Tensor:
    """This rank's contiguous chunk of a full-sequence tensor (ids, masks, labels)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % cp:
        raise ValueError(f"sequence length {x.shape[dim]} does not split into cp={cp} equal "
                         "shards; pad it (with attention_mask 0) to a multiple of cp")
    return x.chunk(cp, dim=dim)[rank]


class KVGather:
    """Stands in for the KV cache: attention's keys and values become the whole sequence's,
    or its first `keys` (all a causal shard's queries can see)."""

    def __init__(self, group: dist.ProcessGroup | None, keys: int | None = None) -> None:
        self.group, self.keys = group, keys

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v  # [batch, kv_heads, local_seq, head_dim] -> [batch, kv_heads, keys, head_dim]
        return (gather_sequence(k, 2, self.group)[:, :, :self.keys],
                gather_sequence(v, 2, self.group)[:, :, :self.keys])


@dataclass(frozen=True)
class PackedShard:
    """Positions [start, start + length) of rows packed by `packed_order` (real tokens
    first), as one cp rank runs them: the rotary positions, and each layer's attention over
    the keys [0, start + length) it can see: None (causal aligned to the last key:
    `Attention`) on full-attention layers, the causal band of `sliding_window` keys on
    sliding-window ones."""
    order: torch.Tensor      # [batch, seq]: `packed_order` of the whole rows
    positions: torch.Tensor  # [batch, length]
    masks: list[Any]
    keys: int
    longest: int | None      # the longest real row, for length-dependent (dynamic) rope

    @classmethod
    def of(cls, cfg: Any, attention_mask: torch.Tensor, start: int, length: int
           ) -> "PackedShard":
        order = packed_order(attention_mask)
        positions = packed_positions(attention_mask, order)[:, start:start + length]
        keys, dev = start + length, attention_mask.device
        masks: list[Any] = [None] * cfg.num_layers
        if cfg.sliding_window is not None:
            q = torch.arange(start, keys, device=dev)[:, None]
            k = torch.arange(keys, device=dev)[None, :]
            band = ((k <= q) & (q - k < cfg.sliding_window))[None, None]
            masks = [band if cfg.layer_window(i) else m for i, m in enumerate(masks)]
        # a device sync, so only where the rope needs it
        longest = int(attention_mask.sum(1).max()) if cfg.rope_by_length else None
        return cls(order, positions, masks, keys, longest)


class ContextParallelBackbone(nn.Module):
    """A `Backbone` on one sequence shard. Holds the backbone's own modules under the same
    names, so state dicts are unchanged."""

    def __init__(self, backbone: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = backbone.config
        self.embed_tokens, self.layers, self.norm, self.unpack = (
            backbone.embed_tokens, backbone.layers, backbone.norm, backbone.unpack)
        self.group = group
        self.routes = None  # an MoE model's `moe.Routes` while `moe.routing` is on

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Any = None) -> torch.Tensor:
        """input_ids, attention_mask  # [batch, seq / cp] shards of rows -> hidden
        [batch, seq / cp, d]: this rank's shard of the rows packed (`packed_order` of the
        whole rows: real tokens first, padding after), which `on_shards` gathers and puts
        back in token order. Packed, causal attention needs no mask, and each shard's
        queries read only the keys up to their own."""
        if cache is not None:
            raise ValueError("context parallelism shards teacher-forced passes; generation "
                             "with a KV cache runs without it")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        length, rank = input_ids.shape[1], dist.get_rank(self.group)
        # the rows' ids and mask are small: each rank gathers them whole to pack its shard
        ids, mask = (gather_sequence(t, 1, self.group) for t in (input_ids, attention_mask))
        shard = PackedShard.of(self.config, mask, rank * length, length)
        if self.routes is not None:  # a replay reads this shard's tokens of the packed rows
            self.routes.order = shard.order[:, rank * length:(rank + 1) * length]
            short = mask.shape[1] - self.routes.replay.shape[1]
            if short > 0:  # `on_shards` padded the rows to a multiple of cp: no routes there
                self.routes.replay = nn.functional.pad(self.routes.replay,
                                                       (0, 0, 0, 0, 0, short), value=-1)
        x = self.embed_tokens(ids.gather(1, shard.order)[:, rank * length:(rank + 1) * length],
                              shard.positions)
        ropes = rope_tables(shard.positions, self.config, x.dtype, shard.longest)
        kv = KVGather(self.group, shard.keys)
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[rope_kind(self.config, i)], shard.masks[i], kv, i)
        return self.unpack(self.norm(x), None)  # packed: `on_shards` unpacks the whole


def context_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The cp group `model` runs its sequence shards over (None without context parallelism)."""
    backbone = getattr(model, "model", None)
    return backbone.group if isinstance(backbone, ContextParallelBackbone) else None


def on_shards(model: nn.Module, forward: Any, input_ids: torch.Tensor,
              attention_mask: torch.Tensor) -> Any:
    """`forward(input_ids, attention_mask)` over whole sequences: directly, or under context
    parallelism on this rank's shard (right-padded to a multiple of cp with masked
    positions), its outputs (a tensor or a tuple, sequence in dim 1) gathered back
    differentiably. Every cp rank then holds the whole outputs, so a loss on them is counted
    cp times: average the parameter gradients over the cp group (`ranks.Share`)."""
    group = context_group(model)
    if group is None:
        return forward(input_ids, attention_mask)
    seq, cp = input_ids.shape[1], dist.get_world_size(group)
    pad = (0, -seq % cp)
    mask = nn.functional.pad(attention_mask, pad)
    out = forward(shard_sequence(nn.functional.pad(input_ids, pad), group),
                  shard_sequence(mask, group))
    order = packed_order(mask)

    def whole(x: torch.Tensor) -> torch.Tensor:
        return unpack(gather_sequence(x.contiguous(), 1, group), order)[:, :seq]
    return tuple(whole(x) for x in out) if isinstance(out, tuple) else whole(out)


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup | None = None
                           ) -> nn.Module:
    """Make `model` (CausalLM, ValueModel or ActorCritic: anything with a `.model` backbone)
    run on sequence shards of `group`, in place; returns it.

    Afterwards every rank calls the model with its `shard_sequence` of input_ids and
    attention_mask and gets its shard of the outputs.
    """
    if isinstance(model.model, ContextParallelBackbone):
        raise ValueError("context parallelism is already applied to this model")
    model.model = ContextParallelBackbone(model.model, group)
    return model
