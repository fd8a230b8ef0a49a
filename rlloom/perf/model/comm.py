"""Alpha-beta cost of the collectives a layout implies, on the link its group spans."""
from __future__ import annotations

from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Layout


def link(hw: Hardware, span: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) for a group whose members lie within `span` consecutive
    devices: NVLink when that fits in a node, else the NIC (the slowest hop of a ring)."""
    if span <= hw.devices_per_node:
        return hw.intra_node_latency, hw.intra_node_bw * hw.comm_eff
    return hw.inter_node_latency, hw.inter_node_bw * hw.comm_eff


def all_reduce(hw: Hardware, size: int, span: int, nbytes: float) -> float:
    """Ring all-reduce of `nbytes` per member over `size` members: 2 (p-1) steps."""
    if size <= 1:
        return 0.0
    alpha, bw = link(hw, span)
    return 2 * (size - 1) * (alpha + nbytes / size / bw)


def gather_or_scatter(hw: Hardware, size: int, span: int, nbytes: float) -> float:
    """Ring all-gather or reduce-scatter; `nbytes` is the full (unsharded) buffer."""
    if size <= 1:
        return 0.0
    alpha, bw = link(hw, span)
    return (size - 1) * (alpha + nbytes / size / bw)


def all_to_all(hw: Hardware, size: int, span: int, nbytes: float) -> float:
    """Pairwise all-to-all of `nbytes` per member: (p-1) rounds of a 1/p share each."""
    return gather_or_scatter(hw, size, span, nbytes)


def p2p(hw: Hardware, span: int, nbytes: float) -> float:
    alpha, bw = link(hw, span)
    return alpha + nbytes / bw


def broadcast_between_groups(hw: Hardware, nbytes: float) -> float:
    """Weight sync from a training group to a separate group holding a copy: one broadcast of
    the whole weights from training rank 0 over a channel spanning the copy's ranks
    (runtime/executor/weight_channel.py); a pipelined broadcast takes about one link's time
    for `nbytes`, whatever the number of receivers."""
    return hw.inter_node_latency + nbytes / (hw.inter_node_bw * hw.comm_eff)


def tp_comm(hw: Hardware, layout: Layout, shape: ModelShape, tokens: float,
             per_layer: int) -> float:
    """`per_layer` all-reduces of [tokens, d] activations (the stream's dtype) in each of the
    device's layers."""
    if layout.tp == 1:
        return 0.0
    nbytes = tokens * shape.hidden * mem.stream_bytes(layout)
    layers = shape.layers / layout.pp
    return per_layer * layers * all_reduce(hw, layout.tp, layout.tp, nbytes)


def ep_comm(hw: Hardware, layout: Layout, shape: ModelShape, tokens: float,
             per_layer: int) -> float:
    """`per_layer` all-to-alls (dispatch and combine, each way) of the k routed copies of each
    token's activations among the ep ranks, in every MoE layer of the device. EP ranks are
    carved out of DP, next to the tp x cp x pp block."""
    if not shape.moe or layout.ep == 1:
        return 0.0
    nbytes = tokens * shape.experts_per_token * shape.hidden * mem.stream_bytes(layout)
    span = layout.tp * layout.cp * layout.pp * layout.ep
    return per_layer * shape.layers / layout.pp * all_to_all(hw, layout.ep, span, nbytes)


def pp_comm(hw: Hardware, layout: Layout, shape: ModelShape, tokens: float, passes: int) -> float:
    if layout.pp == 1:
        return 0.0
    span = layout.tp * layout.cp * layout.pp
    nbytes = tokens * shape.hidden * mem.stream_bytes(layout) / (layout.tp * layout.cp)
    return passes * (layout.pp - 1) * p2p(hw, span, nbytes)


def cp_comm(hw: Hardware, layout: Layout, shape: ModelShape, tokens: float, passes: int) -> float:
    """Ring exchange of K/V blocks: cp - 1 hops per layer per pass."""
    if layout.cp == 1:
        return 0.0
    span = layout.tp * layout.cp
    block = (tokens / layout.cp * 2 * shape.kv_width * mem.PARAM_B
             / min(layout.tp, shape.kv_heads))  # bf16 K and V
    hops = (layout.cp - 1) * shape.layers / layout.pp
    return passes * hops * p2p(hw, span, block)


def dp_comm(shape: ModelShape, layout: Layout, hw: Hardware, micro_batches: int,
             lora_rank: int = 0) -> float:
    """Per optimizer step, as the runtime's `data_parallel.before_backward` runs it. ZeRO-0/1:
    all-reduce bf16 gradients once, in the last micro-batch's backward; ZeRO-2: all-gather
    the parameters once and reduce-scatter the gradients in every micro-batch's backward
    (they stay sharded); ZeRO-3: per micro-batch, all-gather parameters for forward and
    backward and reduce-scatter gradients. With LoRA only the adapters have gradients and
    change; ZeRO-3 still gathers the frozen weights for forward and backward.
    `_exposed_dp` takes off what compute hides. Routed experts under expert parallelism are
    not ZeRO-sharded: their gradients are all-reduced over the dp / ep ranks owning the same
    experts (nothing when ep = dp)."""
    dp, span = layout.dp, layout.world_size
    experts = mem.GRAD_B * mem.expert_params_per_device(shape, layout)
    owners = (all_reduce(hw, dp // layout.ep, span, experts)
              if experts and dp > layout.ep else 0.0)
    weights = mem.GRAD_B * mem.params_per_device(shape, layout) - experts
    grads = mem.GRAD_B * shape.lora_params(lora_rank) if lora_rank else weights
    if layout.zero <= 1:  # replicate all-reduces each wrapped module's gradients
        wrapped = (shape.layers / layout.pp + 1) if dp > 1 else 0
        return owners + max(all_reduce(hw, dp, span, grads), hw.reduce_s * wrapped)
    if layout.zero == 2:  # gathered once a step, kept to the last micro-batch's backward
        return (owners + gather_or_scatter(hw, dp, span, weights)
                + micro_batches * gather_or_scatter(hw, dp, span, grads))
    if lora_rank:
        return micro_batches * (2 * gather_or_scatter(hw, dp, span, weights)
                                + gather_or_scatter(hw, dp, span, grads))
    return owners + micro_batches * 3 * gather_or_scatter(hw, dp, span, grads)
