"""Bytes resident per device: model state by ZeRO stage, activations, KV cache.

The precision is the runtime's with bf16 compute (`train.compute_dtype: auto` on a GPU), and
its rehearsal (`rlloom rehearse`) measures every formula here on the real code:

- a trained model (`runtime.ranks.RankGroup.trained`) keeps fp32 weights, fp32 gradients
  (data parallelism reduces them in fp32) and two fp32 AdamW moments, 16 B per parameter
  before ZeRO sharding; its matmuls read bf16 working copies (`working_weight_bytes`);
- a model that does not train (the reference, a generation copy) is held in bf16, 2 B;
- data parallelism gathers weights in bf16 (`data_parallel.mixed_precision_policy`), so the
  residual stream between layers is bf16; one device, or pipeline stages, compute under
  autocast over fp32 weights, with an fp32 stream.
"""
from __future__ import annotations

from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Layout

PARAM_B = 2   # bf16 weights: frozen models, ZeRO gathers, generation copies, weight sync
GRAD_B = 4    # fp32 gradients, as they are reduced
TRAINED_STATE = (4, 4, 8)  # fp32 weights, fp32 gradients, two fp32 moments
PREFILL_TOKENS = 16384  # padded prompt tokens per prefill forward (rollout.engine.EngineConfig)
DECODE_B = 14  # a decode step's bytes per slot and vocabulary entry: bf16 logits, their fp32
#                copy, log-probs and probabilities (rehearsed: rlloom.rehearsal.generation)
ROLLOUT_B = 20  # per rollout and response position, what the engine returns: the tokens
#                 (int64), their log-probs (fp32) and the tool-output marks (int64)
ROUTE_B = 2  # per position, MoE layer and chosen expert: routing replay's record (int16,
#              rollout/routes.py), over prompt and response
VLLM_BATCHED_TOKENS = 16384  # tokens vLLM's LLM class runs per forward on an H100-class GPU
#                             (its default max_num_batched_tokens there), and profiles
LOGIT_CHUNK = 1024  # tokens of logits alive at once (models.logprobs.LOGIT_CHUNK_TOKENS)
# bytes per logit element of a chunk in training: bf16 logits, fp32 copy, log-softmax, exp,
# the entropy's product and their gradients (tests/models/test_logprobs.py measures 21-22);
# without gradients the bf16 logits, fp32 copy and log-softmax
LOGIT_TRAIN_B, LOGIT_INFER_B = 22, 10
USABLE = 0.9  # fraction of device memory usable: CUDA context, allocator fragmentation


def params_per_device(shape: ModelShape, layout: Layout) -> float:
    """Parameters a device holds before ZeRO sharding: PP splits the layers, and its end
    stages, the busiest, hold the embedding or the head (a tied model's both ends a copy
    each); TP splits the layers' projections (norms, the router, embeddings and the head
    stay whole on every TP rank, as `parallel.tensor_parallel` leaves them), EP the routed
    experts."""
    ends = 1 if shape.tied_embeddings or layout.pp > 1 else 2
    p = (shape.layers * layer_params(shape, Layout(tp=layout.tp)) / layout.pp
         + (shape.vocab * ends + shape.positions) * shape.hidden + shape.norm_params)
    if shape.moe and layout.ep > 1:
        p -= expert_params_per_device(shape, layout) * (layout.ep - 1)
    return p


def expert_params_per_device(shape: ModelShape, layout: Layout) -> float:
    """The routed experts' share of `params_per_device` under expert parallelism (0 without):
    the runtime leaves them out of ZeRO (each is whole on its owners) and sums their
    gradients over the dp / ep ranks that own the same experts."""
    if not shape.moe or layout.ep == 1:
        return 0.0
    return shape.routed_params / (layout.tp * layout.pp * layout.ep)


def model_state_bytes(shape: ModelShape, layout: Layout, trainable: bool,
                      precision: tuple[int, int, int] = TRAINED_STATE, lora_rank: int = 0,
                      offloaded: bool = False) -> float:
    """A trained model's weights, gradients and moments as the runtime shards them: ZeRO-0
    16P; ZeRO-1 8P + 8P/dp (the moments, a whole parameter per rank: `Zero1AdamW`); ZeRO-2
    and ZeRO-3 16P/dp (FSDP2 shards weights and gradients alike; ZeRO-2's unsharded bf16
    copy is a working copy, `working_weight_bytes`). A frozen model: 2P, /dp at ZeRO-3.
    A LoRA base: 4P, /dp at ZeRO-2 and 3.
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
    return _state_parts(shape, layout, trainable, TRAINED_STATE, lora_rank)[0] \
        if layout.offload else 0.0


def _state_parts(shape: ModelShape, layout: Layout, trainable: bool,
                 precision: tuple[int, int, int], lora_rank: int) -> tuple[float, float]:
    """(the ZeRO-sharded state, the routed experts' state) per device."""
    p, dz, zero = params_per_device(shape, layout), layout.dp, layout.zero
    experts = expert_params_per_device(shape, layout)  # never ZeRO-sharded
    if not trainable or lora_rank:
        # a LoRA model's frozen base stays in the trained model's dtype (fp32), sharded as
        # FSDP shards every parameter of a model it wraps (ZeRO-2 and 3); a frozen model is
        # wrapped at ZeRO-3 only (`RankGroup.frozen`)
        held = precision[0] if lora_rank else PARAM_B
        shards = zero == 3 or (zero == 2 and lora_rank)
        base = held * (p - experts) / (dz if shards else 1), held * experts
        if not lora_rank:
            return base
        return base[0] + _trained_bytes(shape.lora_params(lora_rank), dz, zero,
                                        precision), base[1]
    return (_trained_bytes(p - experts, dz, zero, precision, shape.vocab * shape.hidden),
            _trained_bytes(experts, 1, 0, precision))


def _trained_bytes(p: float, dz: int, zero: int, precision: tuple[int, int, int],
                   largest: float = 0.0) -> float:
    param, grad, optim = precision
    if zero == 0:
        return (param + grad + optim) * p
    if zero == 1:  # whole parameters per rank: the largest bounds the busiest rank
        return (param + grad) * p + optim * max(p / dz, largest)
    return (param + grad + optim) * p / dz


def mixed(layout: Layout) -> bool:
    """Data parallelism gathers bf16 weights (`RankGroup.trained` with bf16 compute), as
    `parallel.apply.parallelize` and `parallelize_pipeline` apply it: dp > 1."""
    return layout.dp > 1


def stream_bytes(layout: Layout) -> int:
    """Bytes per element of the residual stream between layers: bf16 where data parallelism
    gathers bf16 weights (`mixed`), else fp32 (autocast over fp32 weights)."""
    return 2 if mixed(layout) else 4


def layer_params(shape: ModelShape, layout: Layout) -> float:
    """One decoder layer's parameters on a device (averaged over the layers where some are
    dense): TP splits its projections (not its norms or router), EP its routed experts."""
    router, experts = shape.router_params, shape.routed_params / shape.layers
    split = shape.attn_params + shape.mlp_params - router - experts * (1 - 1 / layout.ep)
    norms = shape.layer_norms * shape.norm_params + shape.qk_norm_params
    return split / layout.tp + norms + router


def working_weight_bytes(shape: ModelShape, layout: Layout) -> float:
    """bf16 copies of a trained model's weights that its matmuls read, alive from forward to
    the end of backward. With data parallelism at ZeRO-3, the root's (embeddings, head,
    final norm: FSDP keeps the root gathered) and two layers' (one computing, one
    prefetched); at ZeRO 0-2 every weight (the unsharded copy stays). Without it (one
    device, pipeline stages), autocast's copy of every weight, each kept for backward."""
    p, experts = params_per_device(shape, layout), expert_params_per_device(shape, layout)
    # FSDP leaves routed experts under EP out: autocast's copies of every layer's stay for
    # backward (checkpointed, each layer's recompute casts them again)
    kept = 0.0 if layout.activation_checkpointing else 1.0
    # (a pipeline's schedule keeps every weight of its stage gathered across its pieces)
    if mixed(layout) and layout.zero == 3 and layout.pp == 1:  # two layers' experts among them
        layers = shape.layers / layout.pp
        return zero3_gathered_bytes(shape, layout) + PARAM_B * experts * kept * (1 - 2 / layers)
    if mixed(layout):  # FSDP's unsharded bf16 copy of the rest
        return PARAM_B * (p - experts * (1 - kept))
    if layout.pp > 1 and layout.dp > 1 and layout.zero == 3:  # fp32 gathers, then autocast's
        return PARAM_B * p + 2 * 4 * layer_params(shape, layout)
    return PARAM_B * p


def zero3_gathered_bytes(shape: ModelShape, layout: Layout) -> float:
    """bf16 weights a ZeRO-3 pass holds gathered: the root's (embeddings, head, final norm:
    FSDP keeps the root gathered through the pass) and two layers' (one computing, one
    prefetched)."""
    layer = layer_params(shape, layout)
    return PARAM_B * (params_per_device(shape, layout) - (shape.layers / layout.pp - 2) * layer)


# per attention score element a capped (unfused) attention keeps for backward: the bf16
# product, its cap, the masked scores, the fp32 softmax and its bf16 copy
SCORE_B = 12
# gpt-oss's sinks: the fp32 softmax (sink column included) and its bf16 copy
SINK_SCORE_B = 6


def score_bytes(shape: ModelShape, tp: int, context: float) -> float:
    """Per token and layer: the [heads, context] scores an attention without a fused kernel
    (Gemma2's soft-capped, gpt-oss's with sinks) holds, its heads split by TP; none for the
    fused kernels."""
    per = SCORE_B if shape.attn_softcap else SINK_SCORE_B if shape.attn_sinks else 0
    return per * shape.heads / tp * context


def layer_activation_bytes(shape: ModelShape, layout: Layout, context: float = 0.0
                           ) -> float:
    """Bytes one decoder layer keeps for backward per token (rehearsed: tests/perf/
    test_rehearsal.py). Each RMSNorm keeps its input in fp32 (4 d), its normalised output in
    the stream's dtype and the bf16 matmul input (2 d); attention keeps bf16 q, k, v and its
    output (4 q + 4 kv: flash attention on packed causal rows, no mask) and the output's
    fp32 log-sum-exp per head; the SwiGLU keeps its four f-wide bf16 tensors (gate, up, the
    activation and the product). The routed experts' width is experts_per_token x moe_ffn.
    TP splits the widths, and the norms' tensors by sequence
    (its sequence parallelism) but not the bf16 matmul inputs, which it gathers. Capped
    attention adds its scores over a row of `context` keys (`score_bytes`)."""
    stream = stream_bytes(layout)
    wide = 4 * shape.q_width + 4 * shape.kv_width + 8 * shape.active_ffn + 4 * shape.heads
    # TP's sequence-parallel norms keep their share of the sequence; the matmul inputs they
    # feed are gathered whole
    dense = ((shape.layer_norms * (4 + stream) / layout.tp + 4) * shape.hidden
             + wide / layout.tp + score_bytes(shape, layout.tp, context))
    if not shape.moe:
        return dense
    # `models.moe.run_experts` on every routed copy of a token (k of them, whole on every TP
    # rank, each EP rank receiving its share): 4 stream-dtype tensors of d (the expert's
    # input as its matmuls read it, its output, the combined rows and their weighted
    # product), and per token 14 d of the router's and the combine's buffers (rehearsed:
    # 4 s k d + 13.6 d at k = 4 and 8, s = 2 and 4)
    # (averaged over the layers, where some are dense)
    return dense + ((4 * stream * shape.experts_per_token + 14) * shape.hidden
                    * shape.moe_layers / shape.layers)


def activation_bytes(shape: ModelShape, layout: Layout, tokens: float, logits: bool,
                     lora: bool = False, context: float = 0.0) -> float:
    """Training activations per device for one micro-batch of `tokens` (before CP split).
    With checkpointing each layer keeps only its input (the stream's dtype); during a
    layer's backward its recompute and the gradients of those tensors exist. A pipeline
    splits the micro-batch into pp pieces, and under 1F1B its first stage holds all pp of
    them for its L/pp layers: L layers' worth of one piece."""
    t = tokens / layout.cp / layout.pp
    full_layer = t * layer_activation_bytes(shape, layout, context)
    head = _logit_bytes(shape, t, LOGIT_TRAIN_B) if logits else 0.0
    if not layout.activation_checkpointing:  # the head's backward comes first, all layers held
        return full_layer * shape.layers + head
    # each layer's input, and then the larger of
    # the head's backward and a layer's: its recompute and the gradients of its tensors (a
    # third more, rehearsed on Qwen2.5-7B at 8k-33k tokens: 1.34), beside the root's
    # unsharded head gradient that FSDP holds until the last layer's backward (4 B per
    # weight; none when LoRA leaves the head frozen)
    inputs = checkpointed_input_bytes(shape, layout, tokens)
    return inputs + max(head, recompute_bytes(shape, layout, tokens, context)
                        + root_grad_bytes(shape, layout, lora))


def root_grad_bytes(shape: ModelShape, layout: Layout, lora: bool) -> float:
    """The root's unsharded head gradient FSDP holds from the head's backward to the last
    layer's (4 B per weight; none when LoRA leaves the head frozen)."""
    return 4 * shape.vocab * shape.hidden if mixed(layout) and not lora else 0.0


def recompute_bytes(shape: ModelShape, layout: Layout, tokens: float, context: float = 0.0
                    ) -> float:
    """A checkpointed layer's backward: its recompute and the gradients of those tensors, a
    third more than the layer keeps (rehearsed on Qwen2.5-7B at 8k-33k tokens: 1.34)."""
    t = tokens / layout.cp / layout.pp
    return 4 / 3 * t * layer_activation_bytes(shape, layout, context)


def checkpointed_input_bytes(shape: ModelShape, layout: Layout, tokens: float) -> float:
    """Every checkpointed layer's input: the stream, split over the sequence by TP and CP
    (and a pipeline's first stage holding L/pp layers of each of its pp pieces)."""
    return (tokens / layout.cp / layout.pp * stream_bytes(layout) * shape.hidden / layout.tp
            * shape.layers)


def training_transient_bytes(shape: ModelShape, layout: Layout, tokens: float, logits: bool,
                             lora_rank: int = 0, context: float = 0.0) -> float:
    """What one training micro-batch adds to the resident state at its peak: activations and
    working weight copies, less the gradients the resident state counts whole. Backward frees
    activations as it fills gradients, so the peak holds the larger of the two, not their
    sum (rehearsed: within 0.1% at every ZeRO stage on Qwen2.5-7B). A pipeline's first
    stage fills its gradients in the first piece's backward, the other pp - 1 pieces'
    activations still held (1F1B)."""
    acts = activation_bytes(shape, layout, tokens, logits, bool(lora_rank), context)
    working = working_weight_bytes(shape, layout)
    grads = model_state_bytes(shape, layout, True, (0, GRAD_B, 0), lora_rank)
    waiting = (layout.pp - 1) / layout.pp  # of the pieces, when the gradients appear
    # then, on the first stage, the embedding's dense gradient and its copy into the
    # gradient held (rehearsed: Qwen2.5-7B pp 4, 2 x 2 GiB in fp32 at that moment), or on
    # the last the head's, summed over its chunks; with data parallelism in bf16 (`mixed`),
    # beside FSDP's fp32 accumulator (`activation_bytes`' root gradient)
    if layout.pp > 1 and not lora_rank:
        per = PARAM_B if mixed(layout) else GRAD_B
        grads_held = grads + 2 * per * shape.vocab * shape.hidden
        if mixed(layout) and layout.zero >= 2:
            # FSDP under the schedule accumulates unsharded fp32 gradients across the pieces
            # and reduce-scatters them after the last (rehearsed: Qwen2.5-7B pp 4 x dp 2)
            grads_held += GRAD_B * params_per_device(shape, layout) - grads
    else:
        grads_held = grads
    if not layout.activation_checkpointing:
        return max(acts, grads_held + waiting * acts) + working - grads
    # checkpointed, only the layers' inputs are freed as gradients fill; a layer's
    # backward (`rest`) is the same at every layer
    inputs = checkpointed_input_bytes(shape, layout, tokens)
    rest = acts - inputs
    if mixed(layout):  # the gathered weights are there in both; the head's backward
        # (`rest` when it is the larger) comes before the layers' gradients, a layer's
        # recompute once they are held (rehearsed: DeepSeek-V3's and Qwen3-MoE's blocks at
        # ZeRO-3, Qwen2.5 and GPT-2 at ZeRO-3 with tp: 0.98-1.03)
        layer = (recompute_bytes(shape, layout, tokens, context)
                 + root_grad_bytes(shape, layout, bool(lora_rank)))
        return max(inputs + rest, grads_held + waiting * inputs + layer) - grads + working
    # autocast over fp32 weights: its cache holds a bf16 copy of every trained weight to the
    # end of forward (frozen LoRA bases are cast per use), and backward recasts one layer's.
    # The head's backward (`rest` when it is the larger) comes before any layer's gradient, a
    # layer's recompute once the others' are held, the embedding's last: its dense gradient
    # and its copy into the gradient held (rehearsed, one rank: Qwen3-30B-A3B's and
    # DeepSeek-V3's blocks, where it is the peak)
    cached = 0.0 if lora_rank else working
    recast = PARAM_B * layer_params(shape, layout)
    layer = recompute_bytes(shape, layout, tokens, context)
    embedding = 2 * GRAD_B * shape.vocab * shape.hidden if layout.pp == 1 and not lora_rank \
        else 0.0
    return max(inputs + cached, inputs + rest + recast,
               grads_held + waiting * inputs + layer + recast, grads + embedding) - grads


def inference_bytes(shape: ModelShape, layout: Layout, tokens: float, logits: bool,
                    context: float = 0.0) -> float:
    """Forward-only buffers (rehearsed, `rlloom.rehearsal.train.rehearse_scoring`): a layer's
    few hidden-size tensors and its FFN intermediate per token, or later the head's chunk of
    logits, whichever is larger (the layers' are freed before the head runs), beside the
    final hidden states the head reads; at ZeRO-3 the weights gathered meanwhile."""
    t = tokens / layout.cp
    hidden = t * (PARAM_B * (4 * shape.hidden + 2 * max(shape.ffn, shape.moe_ffn) / layout.tp)
                  + score_bytes(shape, layout.tp, context))
    head = _logit_bytes(shape, t, LOGIT_INFER_B) if logits else 0.0
    gathered = zero3_gathered_bytes(shape, layout) if layout.zero == 3 and layout.dp > 1 \
        else 0.0
    return max(hidden, head) + t * PARAM_B * shape.hidden + gathered


def _logit_bytes(shape: ModelShape, tokens: float, per_elem: int) -> float:
    """One chunk of the output head's logits (the head is whole on every TP rank)."""
    return min(tokens, LOGIT_CHUNK) * shape.vocab * per_elem


def kv_bytes_per_rollout(shape: ModelShape, layout: Layout, context: float) -> float:
    """L cache_width bf16 elements per token; TP splits KV heads only up to their number."""
    shards = min(layout.tp, shape.kv_heads) * layout.pp
    return shape.kv_bytes_per_token() * context / shards


def prefill_bytes_per_token(shape: ModelShape, tp: int, context: float = 0.0) -> float:
    """A generation prefill's buffers per token, no gradients (rehearsed: rlloom.rehearsal.
    generation, within 3% on Qwen2.5-7B): its FFN's three f-wide bf16 tensors alive at once
    (the activation, up and their product) and three hidden-size ones (the residual stream,
    its norm and the attention's sum); an unfused (capped) attention's scores over prompts
    of `context` tokens; latent attention's keys and values expanded from its latents."""
    # latent attention's keys and values expanded from the latents (`models.mla`)
    expanded = shape.q_width + shape.v_width if shape.latent else 0
    return (PARAM_B * (3 * shape.active_ffn / tp + 3 * shape.hidden + expanded)
            + score_bytes(shape, tp, context))


def outputs_bytes(shape: ModelShape, rollouts: int, prompt: int, response: int,
                  routes: bool = False) -> float:
    """What generation returns for `rollouts`, held from the start: `ROLLOUT_B` per response
    position, and with `routes` (routing replay) each position's experts in every layer."""
    out = float(ROLLOUT_B * rollouts * response)
    if routes and shape.moe:
        out += (ROUTE_B * rollouts * (prompt + response) * shape.moe_layers
                * shape.experts_per_token)
    return out


def generation_transient_bytes(shape: ModelShape, tp: int, slots: int, prompt: int,
                               samples: int, plain: bool, rollouts: int, response: int,
                               prefill_tokens: int = PREFILL_TOKENS, routes: bool = False
                               ) -> float:
    """What generation adds to its weights and KV cache at its peak: the outputs of its
    `rollouts` of up to `response` tokens, and a prefill forward's buffers or a decode
    step's logits over every slot, whichever is larger. The engine
    prefills as many distinct prompts as `prefill_tokens` take (at most one per `samples`
    slots) and keeps their keys and values until they are placed into slots; the plain loop
    of a tensor-parallel model (`plain`) prefills its whole wave of `slots` rows at once,
    into its cache."""
    if plain:
        prefill = slots * prompt * prefill_bytes_per_token(shape, tp, prompt)
    else:
        prefill = _engine_prefill_bytes(shape, tp, prompt, min(-(-slots // samples),
                                                               prefill_tokens // prompt))
    outputs = outputs_bytes(shape, rollouts, prompt, response, routes)
    return outputs + max(prefill, DECODE_B * slots * shape.vocab)


def _engine_prefill_bytes(shape: ModelShape, tp: int, prompt: int, prompts: int) -> float:
    """One engine prefill of `prompts` prompts (at least one): its buffers and the keys and
    values it captures until they are placed into slots."""
    tokens = max(1, prompts) * prompt
    return tokens * (prefill_bytes_per_token(shape, tp, prompt)
                     + shape.kv_bytes_per_token() / tp)


def generation_slots(shape: ModelShape, tp: int, budget: float, kv_per_slot: float,
                     prompt: int, plain: bool, rollouts: int, response: int,
                     prefill_tokens: int = PREFILL_TOKENS, routes: bool = False) -> int:
    """The most of `rollouts` one replica generates at once in `budget` bytes: each slot's
    KV cache of `kv_per_slot` beside `generation_transient_bytes` (bounded for any number of
    samples per prompt). The engine (`rollout.slot_cache.kv_slots`) and `cost.generation`
    both size generation with it."""
    per_slot = kv_per_slot + DECODE_B * shape.vocab
    reserve = outputs_bytes(shape, rollouts, prompt, response, routes)
    if plain:
        per_slot += prompt * prefill_bytes_per_token(shape, tp, prompt)
    else:
        reserve += _engine_prefill_bytes(shape, tp, prompt, prefill_tokens // prompt)
    return max(0, min(rollouts, int((budget - reserve) // per_slot)))


def vllm_kv_bytes(shape: ModelShape, tp: int, budget: float) -> float:
    """The KV cache a vLLM server gets from `budget` bytes of its device: what is left after
    its own bf16 copy of the weights and the buffers of one forward of its batched tokens.
    rlloom starts vLLM with exactly this (`rollout.vllm_engine.gpu_memory_args`) and the
    cost model prices vLLM's concurrency from it."""
    weights = PARAM_B * params_per_device(shape, Layout(tp=tp))
    return budget - weights - VLLM_BATCHED_TOKENS * prefill_bytes_per_token(shape, tp)
