"""Tensor parallelism (Megatron-style) with sequence parallelism for the norms.

Inside each decoder layer, q/k/v and gate/up are split by output features (colwise) and
o/down by input features (rowwise), so each rank holds `heads/tp` query heads, `kv_heads/tp`
key/value heads and `intermediate/tp` MLP features, and a layer costs one all-gather before
attention and the MLP and one reduce-scatter after them. Between those, the residual stream
and the RMSNorms are sharded along the sequence (sequence parallelism), so norms and
residual adds are not computed `tp` times over.

In an MoE block, each expert's features are split the same way (expert tensor
parallelism): every rank routes the whole sequence, runs its slice of every expert it
holds, and the block's output parts are summed and cut to sequence shards in one
reduce-scatter, as an MLP's are. Expert parallelism, when on, splits the experts
themselves over the dp ranks. The embedding, the final output heads (lm_head, score) and
their inputs stay replicated: the backbone's output is gathered to a plain full tensor, so
every head, loss and sampler works unchanged. All TP ranks therefore compute the same loss.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from rlloom.models.moe import local
from rlloom.models.primitives import RMSNorm
from rlloom.models.transformer import MLP, Attention, Backbone


def backbone_of(model: nn.Module) -> Backbone:
    """The decoder backbone of a CausalLM / ValueModel / ActorCritic (or the backbone itself;
    under context parallelism its wrapper, which holds the same modules)."""
    from rlloom.parallel.context_parallel import ContextParallelBackbone
    if isinstance(model, (Backbone, ContextParallelBackbone)):
        return model
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, (Backbone, ContextParallelBackbone)):
        raise TypeError(f"{type(model).__name__} has no rlloom Backbone at .model")
    return backbone


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard every decoder layer of `model` over the 1-D `tp_mesh`, in place; returns `model`.

    Weights must already be identical on all TP ranks (same seed or same checkpoint): the
    norms are replicated with `from_local`, which does not broadcast.
    """
    tp = tp_mesh.size()
    backbone = backbone_of(model)
    cfg = backbone.config
    if cfg.num_heads % tp or cfg.num_kv_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tp={tp} must divide num_heads={cfg.num_heads}, num_kv_heads="
                         f"{cfg.num_kv_heads} and intermediate_size={cfg.intermediate_size}")
    # The residual stream is a DTensor sharded on the sequence from the embedding output to
    # the final norm. It stays a DTensor (use_local_output=False) rather than a local tensor
    # so DTensor tracks the global length: decoding feeds one token at a time, which tp
    # ranks cannot split evenly, and only DTensor's uneven sharding handles that.
    parallelize_module(backbone, tp_mesh, {
        "embed_tokens": PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Shard(1),
                                            use_local_output=False),
        "norm": SequenceParallel(),
    })
    for layer in backbone.layers:
        shard_layer(layer, tp_mesh)
    # Outputs of the whole backbone are plain and replicated, whatever head comes next: its
    # last module, which restores the token order, takes the whole sequence.
    parallelize_module(backbone, tp_mesh, {"unpack": PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        use_local_output=True)})
    return model


def shard_layer(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard one decoder layer over `tp_mesh`, in place: it then takes and returns the
    residual stream as a DTensor sharded on the sequence (dim 1)."""
    attn = layer.self_attn
    plan: dict[str, Any] = {
        # Attention(x, cos, sin, mask, cache, layer): only x is sharded.
        # The gathered input stays a DTensor so that backward sums the q, k and v (gate and
        # up) projections' partial input gradients locally and reduce-scatters them once;
        # a plain tensor made each projection all-reduce its own (5 all-reduces a layer).
        "self_attn": PrepareModuleInput(input_layouts=(Shard(1),) + (None,) * 5,
                                        desired_input_layouts=(Replicate(),) + (None,) * 5),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
    }
    if isinstance(layer.mlp, MLP):
        plan.update({
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
        if layer.mlp.gated:
            plan["mlp.gate_proj"] = ColwiseParallel()
    else:
        # An MoE block runs on the whole sequence; each rank's expert slices give a part of
        # its output, summed into this rank's sequence shard by one reduce-scatter.
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
            use_local_input=True, output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),), use_local_output=False)
        _shard_experts(layer.mlp, tp_mesh)
    for name in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        if hasattr(layer, name):  # (OLMo2 has no norm before attention; Gemma2 norms
            plan[name] = SequenceParallel()  # around the MLP too) on the sharded stream
    if attn.qk_norm_whole:
        # OLMo2's norms over all heads at once: each rank holds a share of the heads
        attn.q_norm = WholeHeadsNorm(attn.q_norm, tp_mesh)
        attn.k_norm = WholeHeadsNorm(attn.k_norm, tp_mesh)
    elif attn.qk_norm:
        # Per-head norms see only this rank's heads ([b, s, heads/tp, hd], heads on dim
        # 2); a Replicate weight over a head-sharded input makes DTensor sum the weight's
        # gradient over all heads, as the single-process model does.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    parallelize_module(layer, tp_mesh, plan)
    if attn.sinks is not None:  # gpt-oss: each head's sink goes with the head
        attn.sinks = nn.Parameter(distribute_tensor(attn.sinks.data, tp_mesh, [Shard(0)]))
    _localise_heads(attn, tp_mesh.size())


class WholeHeadsNorm(nn.Module):
    """OLMo2's RMSNorm over all heads' queries (or keys) on a rank holding a share of the
    heads: the squares are summed over the TP group (their gradient too), and each rank
    scales its features by its share of the weight."""

    def __init__(self, norm: RMSNorm, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp_mesh, [Shard(0)]))
        self.eps, self.width, self.group = norm.eps, norm.weight.numel(), tp_mesh.get_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        squares = all_reduce(x32.pow(2).sum(-1, keepdim=True), group=self.group)
        x32 = x32 * torch.rsqrt(squares / self.width + self.eps)
        return local(self.weight) * x32.to(x.dtype)


def _shard_experts(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every expert of an MoE block (a whole one, or this rank's share under expert
    parallelism) by features over `tp_mesh`, as an MLP is: gate and up by output rows (and
    their biases with them), down by input columns; down's bias (gpt-oss) stays whole, and
    each rank adds its share of it to its part of the output's sum (`Expert`)."""
    for expert in block.experts.values() if isinstance(block.experts, nn.ModuleDict) \
            else block.experts:
        for linear, dim in ((expert.gate_proj, 0), (expert.up_proj, 0), (expert.down_proj, 1)):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, tp_mesh,
                                                           [Shard(dim)]))
            if linear.bias is not None:
                linear.bias = nn.Parameter(distribute_tensor(
                    linear.bias.data, tp_mesh, [Shard(0) if dim == 0 else Replicate()]))
        expert.tp_group = tp_mesh.get_group()
    block.tp_group = tp_mesh.get_group()


def _localise_heads(attn: Attention, tp: int) -> None:
    # Attention reshapes with these attributes; after colwise sharding the projections give
    # this rank's share of the heads.
    attn.n_heads //= tp
    attn.n_kv //= tp
