"""Bytes resident per device: model state by ZeRO stage, activations, KV cache.

Precision assumption (mixed-precision Adam, as in the ZeRO paper): bf16 parameters (2 B) and
bf16 gradients (2 B), fp32 master weights and two fp32 Adam moments (12 B): 16 B per parameter
before sharding. Frozen models keep bf16 weights only.
"""
from __future__ import annotations

from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Layout

PARAM_B = 2
GRAD_B = 2
OPTIM_B = 12
ACT_B = 2
LOGIT_CHUNK = 1024  # tokens of logits alive at once (models.logprobs.LOGIT_CHUNK_TOKENS)
# bytes per logit element of a chunk in training: bf16 logits, fp32 copy, log-softmax, exp,
# the entropy's product and their gradients (tests/models/test_logprobs.py measures 21-22);
# without gradients the bf16 logits, fp32 copy and log-softmax
LOGIT_TRAIN_B, LOGIT_INFER_B = 22, 10
USABLE = 0.9  # fraction of device memory usable: CUDA context, allocator fragmentation


def params_per_device(shape: ModelShape, layout: Layout) -> float:
    """Parameters a device holds before ZeRO sharding: TP and PP split them, EP the experts."""
    p = shape.params / (layout.tp * layout.pp)
    if shape.moe and layout.ep > 1:
        experts = shape.layers * (shape.mlp_params - shape.hidden * shape.n_experts)
        p -= experts / (layout.tp * layout.pp) * (1 - 1 / layout.ep)
    return p


def expert_params_per_device(shape: ModelShape, layout: Layout) -> float:
    """The routed experts' share of `params_per_device` under expert parallelism (0 without):
    the runtime leaves them out of ZeRO (each is whole on its owners) and sums their
    gradients over the dp / ep ranks that own the same experts."""
    if not shape.moe or layout.ep == 1:
        return 0.0
    experts = shape.layers * (shape.mlp_params - shape.hidden * shape.n_experts)
    return experts / (layout.tp * layout.pp * layout.ep)


MIXED_ADAM = (PARAM_B, GRAD_B, OPTIM_B)
# plain fp32 training: fp32 parameters and gradients, two fp32 moments, no master copy
FP32_ADAM = (4, 4, 8)


def model_state_bytes(shape: ModelShape, layout: Layout, trainable: bool,
                      precision: tuple[int, int, int] = MIXED_ADAM, lora_rank: int = 0,
                      offloaded: bool = False) -> float:
    """ZeRO-0: 16P; ZeRO-1: 4P + 12P/dp; ZeRO-2: 2P + 14P/dp; ZeRO-3: 16P/dp (in elements
    4P, P + 3P/Pz, P + 3P/Pz, 4P/Pz; here in bytes with the precisions above).
    `precision` is bytes per parameter of (parameters, gradients, optimizer state). With
    `lora_rank`, a trained model is its frozen base plus LoRA adapters trained in full (the
    runtime refuses tp, pp and ep with LoRA, so the adapters are whole on every device).
    `offloaded` (`model_state.offloads`): the ZeRO-3 shards are in host memory
    (`host_state_bytes`); the device keeps the routed experts, which are outside ZeRO."""
    sharded, experts = _state_parts(shape, layout, trainable, precision, lora_rank)
    return experts if offloaded else sharded + experts


def host_state_bytes(shape: ModelShape, layout: Layout, trainable: bool,
                     lora_rank: int = 0) -> float:
    """Bytes an offloaded layout keeps in host memory per device: its ZeRO-3 shards."""
    return _state_parts(shape, layout, trainable, MIXED_ADAM, lora_rank)[0] \
        if layout.offload else 0.0


def _state_parts(shape: ModelShape, layout: Layout, trainable: bool,
                 precision: tuple[int, int, int], lora_rank: int) -> tuple[float, float]:
    """(the ZeRO-sharded state, the routed experts' state) per device."""
    p, dz, zero = params_per_device(shape, layout), layout.dp, layout.zero
    experts = expert_params_per_device(shape, layout)  # never ZeRO-sharded
    param = precision[0]
    if not trainable:
        return param * (p - experts) / (dz if zero == 3 else 1), param * experts
    if lora_rank:
        base = _state_parts(shape, layout, False, precision, 0)
        return base[0] + _trained_bytes(shape.lora_params(lora_rank), dz, zero,
                                        precision), base[1]
    return _trained_bytes(p - experts, dz, zero, precision), _trained_bytes(experts, 1, 0,
                                                                           precision)


def _trained_bytes(p: float, dz: int, zero: int, precision: tuple[int, int, int]) -> float:
    param, grad, optim = precision
    if zero == 0:
        return (param + grad + optim) * p
    if zero == 1:
        return (param + grad) * p + optim * p / dz
    if zero == 2:
        return param * p + (grad + optim) * p / dz
    return (param + grad + optim) * p / dz


def zero3_buffer_bytes(shape: ModelShape, layout: Layout) -> float:
    """ZeRO-3 gathers one layer at a time; two layers in flight with prefetch."""
    if layout.zero != 3:
        return 0.0
    return 2 * PARAM_B * params_per_device(shape, layout) / shape.layers


def activation_bytes(shape: ModelShape, layout: Layout, tokens: float, logits: bool) -> float:
    """Training activations per device for one micro-batch of `tokens` (before CP split).

    Per layer and token, d (10 + 24 / tp) bytes in bf16 with flash attention (Korthikanti et al.
    2022, no sequence parallelism); with checkpointing only each layer's bf16 input is kept, plus
    one layer's full activations during recompute. Under 1F1B the first stage holds pp
    micro-batches of L/pp layers, i.e. all L layers' worth.
    """
    t = tokens / layout.cp
    d, layers = shape.hidden, shape.layers
    full_layer = t * d * (10 + 24 / layout.tp)
    if layout.activation_checkpointing:
        acts = t * d * ACT_B * layers + full_layer
    else:
        acts = full_layer * layers
    return acts + (_logit_bytes(shape, t, LOGIT_TRAIN_B) if logits else 0.0)


def inference_bytes(shape: ModelShape, layout: Layout, tokens: float, logits: bool) -> float:
    """Forward-only buffers: a few hidden-size tensors and the FFN intermediate per token."""
    t = tokens / layout.cp
    hidden = t * ACT_B * (4 * shape.hidden + 2 * max(shape.ffn, shape.moe_ffn) / layout.tp)
    return hidden + (_logit_bytes(shape, t, LOGIT_INFER_B) if logits else 0.0)


def _logit_bytes(shape: ModelShape, tokens: float, per_elem: int) -> float:
    """One chunk of the output head's logits (the head is whole on every TP rank)."""
    return min(tokens, LOGIT_CHUNK) * shape.vocab * per_elem


def kv_bytes_per_rollout(shape: ModelShape, layout: Layout, context: float) -> float:
    """2 L kv_width bf16 elements per token; TP splits KV heads only up to their number."""
    shards = min(layout.tp, shape.kv_heads) * layout.pp
    return shape.kv_bytes_per_token() * context / shards
