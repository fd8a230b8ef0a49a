"""The collectives a layout implies, as records (`Collective`: what is sent, over which
group), and their alpha-beta time on the link the group spans. A stage's collectives are
built here once; the cost model prices them and the rehearsal compares their bytes with the
ones the runtime sends (`rehearsal.comm`)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload
from rlloom.plan import Layout


@dataclass(frozen=True)
class Collective:
    """`calls` collectives of one kind over a group of `size` members lying within `span`
    consecutive devices, `nbytes` in all of them together: a member's buffer for an
    all-reduce or all-to-all, the whole (unsharded) buffer for an all-gather or
    reduce-scatter, the message for a broadcast or point-to-point send."""
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | p2p
    size: int
    span: int
    nbytes: float
    calls: float = 1.0

    def sent(self) -> float:
        """Bytes a member sends: a ring's 2(p-1)/p of the buffer for an all-reduce, (p-1)/p
        for a gather, scatter or all-to-all; a pipelined broadcast or a send forwards all."""
        if self.kind in ("broadcast", "p2p"):
            return self.nbytes
        if self.size <= 1:
            return 0.0
        share = (self.size - 1) / self.size
        return (2 * share if self.kind == "all_reduce" else share) * self.nbytes

    def seconds(self, hw: Hardware) -> float:
        if self.size <= 1 and self.kind != "p2p":
            return 0.0
        alpha, bw = link(hw, self.span)
        if self.kind in ("broadcast", "p2p"):
            return self.calls * alpha + self.nbytes / bw
        steps = 2 * (self.size - 1) if self.kind == "all_reduce" else self.size - 1
        return steps * (self.calls * alpha + self.nbytes / self.size / bw)


def seconds(hw: Hardware, collectives: Iterable[Collective]) -> float:
    return sum(c.seconds(hw) for c in collectives)


def sent(collectives: Iterable[Collective]) -> float:
    """Bytes a member sends in all of `collectives`."""
    return sum(c.sent() for c in collectives)


def link(hw: Hardware, span: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) for a group whose members lie within `span` consecutive
    devices: NVLink when that fits in a node, else the NIC (the slowest hop of a ring)."""
    if span <= hw.devices_per_node:
        return hw.intra_node_latency, hw.intra_node_bw * hw.comm_eff
    return hw.inter_node_latency, hw.inter_node_bw * hw.comm_eff


def broadcast_between_groups(hw: Hardware, nbytes: float) -> float:
    """Weight sync from a training group to a separate group holding a copy: one broadcast of
    the whole weights from training rank 0 over a channel spanning the copy's ranks
    (runtime/executor/weight_channel.py); a pipelined broadcast takes about one link's time
    for `nbytes`, whatever the number of receivers."""
    return hw.inter_node_latency + nbytes / (hw.inter_node_bw * hw.comm_eff)


def tp(layout: Layout, shape: ModelShape, tokens: float, per_layer: int,
       ends: int) -> list[Collective]:
    """`per_layer` all-reduces' worth of [tokens, d] bf16 activations in each of the device's
    layers: sequence parallelism's all-gather before attention and the MLP and reduce-scatter
    after them (and their transposes in backward) send what an all-reduce does; and `ends`
    all-gathers of the residual stream (its dtype) where the backbone's sequence shards are
    made whole: its output in forward, the embedding's gradient in backward."""
    if layout.tp == 1:
        return []
    row = tokens * shape.hidden
    calls = per_layer * shape.layers / layout.pp
    return [Collective("all_reduce", layout.tp, layout.tp, calls * row * mem.PARAM_B, calls),
            Collective("all_gather", layout.tp, layout.tp,
                       ends * row * mem.stream_bytes(layout), ends)]


def ep(layout: Layout, shape: ModelShape, tokens: float, per_layer: int) -> list[Collective]:
    """`per_layer` all-to-alls (dispatch and combine, each way) of the k routed copies of each
    token's activations among the ep ranks, in every MoE layer of the device. EP ranks are
    carved out of DP, next to the tp x cp x pp block."""
    if not shape.moe or layout.ep == 1:
        return []
    nbytes = tokens * shape.experts_per_token * shape.hidden * mem.stream_bytes(layout)
    span = layout.tp * layout.cp * layout.pp * layout.ep
    calls = per_layer * shape.moe_layers / layout.pp
    return [Collective("all_to_all", layout.ep, span, calls * nbytes, calls)]


def pp(layout: Layout, shape: ModelShape, tokens: float, pieces: float,
       backward: bool) -> list[Collective]:
    """A stage sends each of `pieces` pipeline micro-batches' [tokens, d] boundary
    activations to the next stage, and in backward their gradients to the previous: a
    middle stage both, an end stage one of them (with 2 stages, each is an end)."""
    if layout.pp == 1:
        return []
    span = layout.tp * layout.cp * layout.pp
    nbytes = tokens * shape.hidden * mem.stream_bytes(layout) / (layout.tp * layout.cp)
    calls = pieces * (2 if backward and layout.pp > 2 else 1)
    return [Collective("p2p", 2, span, calls * nbytes, calls)]


def cp(layout: Layout, shape: ModelShape, tokens: float, forwards: int,
       backward: bool) -> list[Collective]:
    """`parallel.context_parallel` over `tokens` (the whole rows): each of `forwards` passes
    (2 when checkpointing recomputes them) all-gathers every layer's keys (the stream's
    dtype: rotary runs in it) and values (bf16), a TP rank its own KV heads (latent
    attention: its latents and rotary keys, `cache_width`); backward
    returns their gradients by all-to-all. The hidden states are gathered whole at the end
    (and their gradient returned)."""
    if layout.cp == 1:
        return []
    span, layers = layout.tp * layout.cp, shape.layers / layout.pp
    kv = (tokens * shape.cache_width / 2 * (mem.stream_bytes(layout) + mem.PARAM_B)
          / min(layout.tp, shape.kv_heads))
    hidden = tokens * shape.hidden * mem.stream_bytes(layout)
    out = [Collective("all_gather", layout.cp, span, forwards * layers * kv + hidden,
                      forwards * layers + 1)]
    if backward:
        out.append(Collective("all_to_all", layout.cp, span, layers * kv + hidden, layers + 1))
    return out


def cp_grads(shape: ModelShape, layout: Layout, lora_rank: int = 0) -> list[Collective]:
    """Each cp rank's gradients are partial sums (`ranks.Share.reduce`): all-reduced over the
    cp group once a step, fp32, as ZeRO leaves them sharded."""
    if layout.cp == 1:
        return []
    grads = mem.model_state_bytes(shape, layout, True, (0, mem.GRAD_B, 0), lora_rank)
    return [Collective("all_reduce", layout.cp, layout.tp * layout.cp, grads)]


def dp(shape: ModelShape, layout: Layout, micro_batches: int,
       lora_rank: int = 0) -> list[Collective]:
    """Per optimizer step, as the runtime's `data_parallel.before_backward` runs it, weights
    gathered in the stream's dtype (bf16 under mixed precision) and gradients reduced in
    fp32. ZeRO-0/1: all-reduce the gradients once, in the last micro-batch's backward, and
    at ZeRO-1 each rank then broadcasts the fp32 parameters it stepped (`Zero1AdamW`);
    ZeRO-2: all-gather the parameters once and reduce-scatter the gradients in every
    micro-batch's backward (they stay sharded); ZeRO-3: per micro-batch, all-gather
    the layers' parameters for forward and backward, the root's (embeddings, head) once,
    and reduce-scatter gradients. With LoRA only the
    adapters have gradients and change; ZeRO-3 still gathers the frozen weights for forward
    and backward. Routed experts under expert parallelism are not ZeRO-sharded: their
    gradients are all-reduced over the dp / ep ranks owning the same experts (nothing when
    ep = dp)."""
    d, span = layout.dp, layout.world_size
    expert_params = mem.expert_params_per_device(shape, layout)
    out = []
    if expert_params and d > layout.ep and not lora_rank:
        out.append(Collective("all_reduce", d // layout.ep, span, mem.GRAD_B * expert_params))
    weights = mem.params_per_device(shape, layout) - expert_params
    gathered = mem.stream_bytes(layout) * weights
    grads = mem.GRAD_B * (shape.lora_params(lora_rank) if lora_rank else weights)
    if layout.zero <= 1:
        out.append(Collective("all_reduce", d, span, grads))
        if layout.zero == 1:  # fp32 parameters, as many as their gradients
            out.append(Collective("broadcast", d, span, grads, d))
    elif layout.zero == 2:  # gathered once a step, kept to the last micro-batch's backward
        out += [Collective("all_gather", d, span, gathered),
                Collective("reduce_scatter", d, span, micro_batches * grads, micro_batches)]
    else:  # the root (embeddings, head, final norm) stays gathered from forward to backward
        layers = shape.layers / layout.pp * mem.layer_params(shape, layout) - expert_params
        twice = mem.stream_bytes(layout) * layers
        out += [Collective("all_gather", d, span, micro_batches * (gathered + twice),
                           2 * micro_batches),
                Collective("reduce_scatter", d, span, micro_batches * grads, micro_batches)]
    return [c for c in out if c.size > 1]


def training(shape: ModelShape, layout: Layout, wl: Workload, role: str,
             prompts_once: bool = False) -> dict[str, list[Collective]]:
    """A device's collectives in one optimizer step: "model", those among the tp / cp / ep /
    pp ranks of every micro-batch's passes, and "dp", the step's gradient collectives (`dp`,
    `cp_grads`)."""
    ckpt = layout.activation_checkpointing
    lora = wl.lora_rank if role == "actor" else 0
    _, tokens, m = wl.device_minibatch(layout.dp, prompts_once, layout.pp)
    mb_tokens, pieces = tokens / m, layout.pp
    # Under TP an MoE block's backward also sums the gradient its experts' feature slices
    # give the (replicated) tokens over the tp ranks: one more all-reduce per layer.
    tp_per_layer = (6 if ckpt else 4) + (1 if shape.moe else 0)
    per_mb = (tp(layout, shape, mb_tokens / layout.cp, tp_per_layer, 2)
              + cp(layout, shape, mb_tokens, 1 + ckpt, True)
              + ep(layout, shape, mb_tokens / layout.cp, 6 if ckpt else 4))
    model = [replace(c, nbytes=m * c.nbytes, calls=m * c.calls) for c in per_mb]
    model += pp(layout, shape, mb_tokens / pieces, m * pieces, True)
    return {"model": model,
            "dp": dp(shape, layout, m, lora) + cp_grads(shape, layout, lora)}


def dp_comm(shape: ModelShape, layout: Layout, hw: Hardware, micro_batches: int,
            lora_rank: int = 0) -> float:
    """Seconds of `dp`'s collectives. `replicate` all-reduces each wrapped module's gradients
    separately: no faster than one reduction launch per module. `_exposed_dp` takes off
    what compute hides."""
    t = seconds(hw, dp(shape, layout, micro_batches, lora_rank))
    if layout.zero <= 1 and layout.dp > 1:
        t = max(t, hw.reduce_s * (shape.layers / layout.pp + 1))
    return t
