"""Context parallelism: the sequence dimension sharded over the ranks of a cp group.

Rank r holds the contiguous positions [r * s / cp, (r + 1) * s / cp) of every row. Everything
but attention is position-wise and runs on the shard as is. Attention all-gathers keys and
values along the sequence: each rank's queries attend to the whole gathered sequence under a
causal mask offset by the shard's start, and rotary embeddings use the tokens' global positions
(rotated before the gather, so the gathered keys are already correct). The gather's backward is
a reduce-scatter (done as an all-to-all plus a sum, which gloo supports), so key/value gradients
from every rank's queries return to the rank that owns those positions.

Why all-gather and not ring attention: ring attention passes K/V blocks between neighbours while
computing, keeping K/V memory per rank at s / cp and overlapping communication, but it needs
blockwise attention with log-sum-exp merging and a hand-written backward. The all-gather is the
simplest scheme that is exactly the single-process computation: its cost is full-length K/V per
rank per layer (kept for backward), and with gloo on CPU there is no overlap to gain. Contiguous
shards also leave the causal work unbalanced (the last rank's queries see the most keys); a
zig-zag assignment would balance it.

The model code is not touched: `apply_context_parallel` swaps the backbone for a wrapper that
computes global positions and masks, and hands each layer a key/value gatherer in the slot that
attention uses for its KV cache (`cache.update(layer, k, v)` returns the keys and values to
attend to). Parameter gradients are each rank's partial sums: all-reduce (sum) them over the cp
group, as data parallelism does over dp, with a loss normalised over the whole sequence.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlloom.models.transformer import layer_masks, rotary_cos_sin


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
    """Stands in for the KV cache: attention's keys and values become the whole sequence's."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v  # [batch, kv_heads, local_seq, head_dim] -> [batch, kv_heads, seq, head_dim]
        return gather_sequence(k, 2, self.group), gather_sequence(v, 2, self.group)


def shard_positions_and_mask(full_mask: torch.Tensor, start: int, length: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions [batch, length] and attention mask [batch, 1, length, seq] of the
    queries at [start, start + length), by the same rule as `positions_and_mask`: keys up to
    the query that are not padding, and always the query itself."""
    seq = full_mask.shape[1]
    positions = (full_mask.cumsum(1) - 1)[:, start:start + length].clamp(min=0)
    q = torch.arange(start, start + length, device=full_mask.device)[:, None]
    k = torch.arange(seq, device=full_mask.device)[None, :]
    mask = ((k <= q) & full_mask.bool()[:, None, :]) | (k == q)
    return positions, mask[:, None]


class ContextParallelBackbone(nn.Module):
    """A `Backbone` on one sequence shard. Holds the backbone's own modules under the same
    names, so state dicts are unchanged."""

    def __init__(self, backbone: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = backbone.config
        self.embed_tokens, self.layers, self.norm, self.unpack = (
            backbone.embed_tokens, backbone.layers, backbone.norm, backbone.unpack)
        self.group = group

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: Any = None) -> torch.Tensor:
        """input_ids, attention_mask  # [batch, seq / cp] shards -> hidden [batch, seq / cp, d]"""
        if cache is not None:
            raise ValueError("context parallelism shards teacher-forced passes; generation "
                             "with a KV cache runs without it")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        length = input_ids.shape[1]
        parts = [torch.empty_like(attention_mask) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, attention_mask.contiguous(), group=self.group)
        full = torch.cat(parts, 1)
        positions, mask = shard_positions_and_mask(full, dist.get_rank(self.group) * length,
                                                   length)
        masks = layer_masks(self.config, mask, dist.get_rank(self.group) * length)
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config, x.dtype,
                                  longest=int(full.sum(1).max()))
        kv = KVGather(self.group)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, masks[i], kv, i)
        return self.unpack(self.norm(x), None)  # in token order: no packing here


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
    out = forward(shard_sequence(nn.functional.pad(input_ids, pad), group),
                  shard_sequence(nn.functional.pad(attention_mask, pad), group))

    def whole(x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x.contiguous(), 1, group)[:, :seq]
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
