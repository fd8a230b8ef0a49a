"""Per-stage, per-role cost: FLOPs, HBM bytes, depth, seconds and transient memory per device.

time = max(FLOPs / (peak * eff), bytes / (bw * eff)) + alpha-beta communication. Device groups
are laid out TP innermost, then CP, then PP, then DP, so a group of stride s and size p spans
s * p consecutive devices.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from rlloom.perf.model import comm
from rlloom.perf.model import memory as mem
from rlloom.perf.model.engine_schedule import (EngineSchedule, engine_schedule, queue_lengths,
                                               static_schedule, turn_plans)
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.model_state import offload_copy_s, optimizer_s
from rlloom.perf.model.partial_pool import pool_steps
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload, pipeline_rows
from rlloom.plan import Layout

ENGINE_POINTS = 2048  # rollouts simulated one by one per replica; beyond, each stands for several
VLLM_MAX_SEQS = 256  # vLLM's default max_num_seqs (what rollout.engine=vllm starts it with)
# Operators dispatched by rlloom's runtime, per decoder layer and per call (counted with a
# TorchDispatchMode on rlloom's own model; tests/perf/test_validate.py recounts them). They
# price `Hardware.launch_s`, the host's time per operator (see `_with_dispatch`).
FORWARD_OPS = (87, 45)  # a teacher-forced forward (prefill or micro-batch): per layer, fixed
DECODE_OPS = (77, 123)  # one decode step of the generation engine, sampling included
OPTIMIZER_OPS = (110, 42)  # gradient clipping + AdamW step + zero_grad: per layer, fixed
# one training pass (a micro-batch, or the shared prompt pass): forward, backward, log-probs,
# entropy and the objective, counted on the runtime's training stage
TRAIN_OPS = (270, 185)
TRAIN_ACTIVATION_PASSES = 3.5  # forward + backward activation traffic, in forwards (counted)


@dataclass(frozen=True)
class StageCost:
    """One role's share of one stage. `flops` is summed over all devices (generation: dp
    times the slowest replica's, which holds the batch's longest response); the rest per
    device."""
    stage: str
    role: str
    flops: float
    bytes_moved: float
    depth: float  # critical path length in dependent operations (work-depth proxy)
    compute_s: float
    memory_s: float
    comm_s: float
    seconds: float
    transient_bytes: float  # KV cache / activations / buffers on top of the resident state
    note: str = ""
    wait_s: float = 0.0  # of `seconds`, idle waiting on tools (multi-turn generation)
    dispatch_s: float = 0.0  # the host's operator dispatch, hidden or not (`_with_dispatch`)


def _ops(per: tuple[int, int], shape: ModelShape, layout: Layout) -> float:
    return per[0] * shape.layers / layout.pp + per[1]


def _with_dispatch(device_s: float, host_s: float, hw: Hardware) -> float:
    """Seconds of work the device does in `device_s` while the host spends `host_s` issuing
    it: their sum where the device computes in the dispatching thread (a CPU), the longer of
    the two where the host queues ahead of it (a GPU, `Hardware.dispatch_overlap`)."""
    return device_s + host_s - hw.dispatch_overlap * min(device_s, host_s)


def _wrapper_s(hw: Hardware, shape: ModelShape, layout: Layout, trained: bool) -> float:
    """FSDP2's hooks over one forward and backward of a micro-batch (`Hardware.wrapped_pass_s`
    per wrapped module: each decoder layer of the stage, and its root)."""
    if layout.dp == 1 or not (trained or layout.zero == 3):
        return 0.0
    return hw.wrapped_pass_s * (shape.layers / layout.pp + 1)


def _activation_s(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware,
                  tokens: float) -> float:
    """Memory time of the non-matmul operators over `tokens` forward tokens. These kernels
    run between the matmuls, not under them, so the time adds to the matmul roofline."""
    per_device = tokens * shape.activation_elems_per_token() / (layout.tp * layout.pp)
    return per_device * wl.elem_bytes / (hw.mem_bw * hw.mem_eff)


def _attention_s(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware,
                 tokens: float, context: float) -> float:
    """Time one teacher-forced forward's fused attention takes beyond its FLOPs (already in
    the compute roofline) where its per-element work bounds it: `tokens` queries each
    scoring context/2 keys on average per layer and query head, at `Hardware.attn_elem_s`
    as measured, not slowed by the efficiencies: the kernel works on tiles in cache (the
    built-in model's forward over 4,096 tokens grows 118-130 ms measured from 64- to
    2,048-token rows; priced +103 ms so, +60 ms on the FLOPs alone)."""
    if hw.attn_elem_s == 0:
        return 0.0
    shards = layout.tp * layout.pp * layout.cp
    elems = tokens * shape.layers * shape.heads * context / 2 / shards
    flops = tokens * shape.attention_flops(context) / shards
    return max(0.0, elems * hw.attn_elem_s - flops / hw.flops(wl.dtype))


def _log2(x: float) -> float:
    return math.log2(max(x, 2.0))


def forward_depth(shape: ModelShape, context: float) -> float:
    """D_f = L [log d + log(S+T)] + log d: reductions over the hidden size and the context."""
    return shape.layers * (_log2(shape.hidden) + _log2(context)) + _log2(shape.hidden)


def _bubble(layout: Layout) -> float:
    """Time multiplier of pipeline stages. The runtime runs each micro-batch as one 1F1B (or
    forward-only GPipe) schedule of pp pipeline micro-batches (runtime/stages/pipelined.py),
    so every micro-batch fills and drains the pipeline: 1 / (1 - (pp-1)/(m+pp-1)), m = pp."""
    return (2 * layout.pp - 1) / layout.pp


def _weight_bytes(shape: ModelShape, layout: Layout, wl: Workload) -> float:
    return wl.elem_bytes * mem.params_per_device(shape, layout)


def generation(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware,
               kv_budget: float, role: str = "actor") -> StageCost:
    """Generation as rlloom's engine runs it (rollout/engine.py): continuous batching over
    KV slots sized at the longest context, as many per replica as `kv_budget` bytes per
    device hold (capped by `wl.max_batch`; on vLLM, `wl.engine`, at the mean context,
    paged, and at most VLLM_MAX_SEQS); a finished slot takes the next rollout before the
    next decode step, and a prompt is prefilled once for its K samples when its first sample
    is admitted (`engine_schedule`). Each decode step is bound by compute or by reading
    weights + live KV, plus communication and operator dispatch."""
    per_replica = math.ceil(wl.rollouts / layout.dp)
    kv_one = mem.kv_bytes_per_rollout(shape, layout, wl.max_context)
    cap = wl.max_batch or per_replica
    response = math.ceil(wl.response.max)
    plain = plain_loop(layout, wl, shape)
    if wl.engine == "vllm":
        # paged: a rollout holds the blocks it has filled, on average its mean context, and
        # the longest one must fit alone (vLLM preempts and recomputes the rest meanwhile;
        # not priced)
        # vLLM is handed the whole budget and reserves its KV cache in it up front
        kv = mem.vllm_kv_bytes(shape, layout.tp, kv_budget)
        if kv_one > max(kv, 0):
            return _infeasible("generation", role, kv_one)
        kv_one = mem.kv_bytes_per_rollout(shape, layout, wl.mean_context)
        cap = min(cap, VLLM_MAX_SEQS)
        fit = int(kv // kv_one)
    else:  # the engine's own rule (`rollout.slot_cache.kv_slots`)
        fit = mem.generation_slots(shape, layout.tp, kv_budget, kv_one, wl.prompt_len, plain,
                                   per_replica, response, routes=wl.routing_replay)
    concurrent = min(per_replica, fit, cap)
    if concurrent < 1:
        return _infeasible("generation", role, kv_one)
    held = kv_budget if wl.engine == "vllm" else concurrent * kv_one + \
        mem.generation_transient_bytes(shape, layout.tp, concurrent, wl.prompt_len,
                                       wl.samples, plain, per_replica, response,
                                       routes=wl.routing_replay)
    # the micro-batch size is the teacher-forced passes' alone: the planner's search over
    # it reuses one simulation
    key = (shape, layout.tp, layout.pp, layout.dp, layout.cp, layout.ep,
           replace(wl, micro_batch=0), hw.key(), concurrent)
    if key not in _GEN_CACHE:
        _GEN_CACHE[key] = _generate(shape, layout, wl, hw, concurrent, per_replica, role)
    return replace(_GEN_CACHE[key], transient_bytes=held)


def plain_loop(layout: Layout, wl: Workload, shape: ModelShape) -> bool:
    """Whether generation runs the engine's plain loop (`rollout.engine.Engine` on a model
    whose modules tensor parallelism drives, or latent attention's) rather than its slots."""
    return wl.engine == "rlloom" and (layout.tp > 1 or shape.latent)


_GEN_CACHE: dict[tuple, StageCost] = {}  # the planner prices the same generation many times


def _generate(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware, concurrent: int,
              per_replica: int, role: str) -> StageCost:
    """The time of `concurrent` rollouts at once (its bytes held are the caller's)."""
    wait = 0.0
    if wl.carries:
        totals, decode_steps, prefills = _partial_totals(shape, layout, wl, hw, concurrent)
        how = f"partial rollouts of {wl.partial_tokens} tokens a step"
    else:
        # beyond ENGINE_POINTS rollouts a simulated rollout stands for `weight` of them
        points = min(per_replica, ENGINE_POINTS)
        weight = per_replica / points
        slots, samples = max(1, round(concurrent / weight)), max(1, round(wl.samples / weight))
        lengths = queue_lengths(wl, points)
        if plain_loop(layout, wl, shape):
            # a multi-turn rollout's turns priced as one response (their tool waits left out)
            sched = static_schedule(lengths, slots)
            how = "static waves (a tensor-parallel model runs the plain loop)"
        else:
            sched = _single_turn_schedule(lengths, slots, samples)
            how = "continuous batching"
        totals = _schedule_totals(sched, weight, shape, layout, wl, hw)
        if wl.turns > 1 and not plain_loop(layout, wl, shape):
            # the tools' latencies in decode steps at the single-turn schedule's pace
            step_s = totals[5] / max(sched.decode_steps, 1)
            sched = engine_schedule(lengths, slots, samples,
                                    turns=turn_plans(wl, lengths, step_s))
            totals = _schedule_totals(sched, weight, shape, layout, wl, hw)
            wait = sched.idle_steps * step_s
            totals[5] += wait
            how += (f", {wl.turns} turns per rollout ({len(sched.extends) * weight:.0f} "
                    f"extend forwards; {wait:.3g} s idle, every slot waiting on a tool)")
        decode_steps, prefills = sched.decode_steps, len(sched.prefills)
    flops, nbytes, compute_s, memory_s, comm_s, seconds, dispatch_s = totals
    depth = forward_depth(shape, wl.max_context) * wl.response.max
    note = (f"{concurrent} of {per_replica} rollouts per replica at once, {how}: "
            f"{decode_steps:.0f} decode steps, {prefills:.0f} prefill forwards")
    return StageCost("generation", role, layout.dp * flops, nbytes, depth, compute_s,
                     memory_s, comm_s, seconds, 0.0, note, wait, dispatch_s)


@functools.lru_cache(maxsize=4096)  # layouts of the same replica size share one simulation
def _single_turn_schedule(lengths: tuple[int, ...], slots: int, samples: int) -> EngineSchedule:
    return engine_schedule(lengths, slots, samples)


def _schedule_totals(sched: EngineSchedule, weight: float, shape: ModelShape, layout: Layout,
                     wl: Workload, hw: Hardware, resumed_tokens: float = 0.0) -> list[float]:
    """[flops, bytes, compute_s, memory_s, comm_s, seconds, dispatch_s] of one replica running
    `sched`, each simulated rollout standing for `weight`; `resumed_tokens`: context that
    carried partial rollouts prefill again (their tokens so far) on top of their prompts."""
    flops_s = hw.flops(wl.dtype) * layout.tp  # decode has no sequence to split: CP idles
    bw = hw.mem_bw * hw.mem_eff
    s = wl.prompt_len
    pp = layout.pp
    # A replica's tokens cross its pp stages one after another (prefill runs as one batch,
    # decode one token at a time), so the per-stage costs (reads, TP and EP collectives,
    # non-matmul operators, launches) add up over the stages: PP saves memory here, not time.
    totals = [0.0] * 7  # flops, bytes, compute_s, memory_s, comm_s, seconds, dispatch_s
    logits = 2 * shape.vocab * shape.hidden
    prompts_total = sum(sched.prefills) * weight
    prefill: dict[int, tuple[float, ...]] = {}  # by prompts admitted, as `per_live` below
    for simulated in sched.prefills:
        if simulated not in prefill:
            prompts = simulated * weight
            tokens = prompts * s + resumed_tokens * prompts / max(prompts_total, 1e-9)
            context = tokens / prompts
            f = prompts * (context * shape.forward_flops(context, logits=False) + logits)
            prefill[simulated] = _forwards(shape, layout, wl, hw, f, tokens,
                                           math.ceil(tokens / mem.PREFILL_TOKENS))
        for k, v in enumerate(prefill[simulated]):
            totals[k] += v
    kv_tok = shape.kv_bytes_per_token(wl.elem_bytes) / min(layout.tp, shape.kv_heads)
    # an extend forward appends a tool's result to one parked rollout, about half way through
    # its response: the weights read for a few tokens
    pos = s + wl.response.mean / 2
    for m in sched.extends:
        f = weight * (m * shape.forward_flops(2 * pos, logits=False) + logits)
        for k, v in enumerate(_forwards(shape, layout, wl, hw, f, m * weight, weight,
                                        weight * pos * kv_tok)):
            totals[k] += v
    # rlloom's engine dispatches each operator of a decode step (the plain loop: of a whole
    # forward); vLLM replays CUDA graphs
    ops = FORWARD_OPS if plain_loop(layout, wl, shape) else DECODE_OPS
    dispatch = pp * hw.launch_s * _ops(ops, shape, layout) if wl.engine == "rlloom" else 0.0
    # the projections (weights read, rows x params of compute) and attention (each row's keys
    # and values read) are separate kernels, each bound by its own roofline: with many rows
    # the projections are compute-bound while attention stays memory-bound
    proj_row = shape.decode_flops(0)
    attn_row_key = shape.decode_flops(1) - proj_row
    # a segment's costs but attention depend only on its live rows, which repeat (full slots):
    # computed once per row count, since a search prices millions of segments
    per_live: dict[int, tuple[float, float, float]] = {}
    for steps, simulated, generated, widest in sched.segments:
        live = simulated * weight
        if simulated not in per_live:
            per_live[simulated] = (
                live * proj_row, _decode_weight_bytes(shape, layout, wl, live) * pp,
                pp * (comm.seconds(hw, comm.tp(layout, shape, live, 2, 1)
                                   + comm.ep(layout, shape, live, 2))
                      + _activation_s(shape, layout, wl, hw, live))
                + comm.seconds(hw, comm.pp(layout, shape, live, 1, False)))
        f_proj, b_proj, c = per_live[simulated]
        # keys each row attends to, mean over the segment: vLLM's paged attention reads each
        # rollout's own context; rlloom's engine reads every row up to the widest one
        keys = s + (widest if wl.engine == "rlloom" else generated / simulated) \
            + (steps - 1) / 2
        f_attn, b_attn = live * keys * attn_row_key, live * keys * kv_tok
        f, b = f_proj + f_attn, b_proj + b_attn
        device = max(f_proj / flops_s, b_proj / bw) + max(f_attn / flops_s,
                                                          b_attn / (bw * hw.attn_eff))
        step = _with_dispatch(device + c, dispatch, hw) + hw.decode_step_s
        for k, v in enumerate((f, b, f / flops_s, b / bw, c, step,
                               dispatch + hw.decode_step_s)):
            totals[k] += steps * v
    return totals


def _forwards(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware, flops: float,
              tokens: float, forwards: float, kv_bytes: float = 0.0) -> tuple[float, ...]:
    """(flops, bytes, compute_s, memory_s, comm_s, seconds, dispatch_s) of `forwards`
    generation-side forwards (prefills, extends) of `tokens` tokens in all, doing `flops`:
    each reads the weights once per pp stage; `kv_bytes`: the cached keys and values they
    read too."""
    flops_s, bw, pp = hw.flops(wl.dtype) * layout.tp, hw.mem_bw * hw.mem_eff, layout.pp
    b = forwards * _weight_bytes(shape, layout, wl) * pp + kv_bytes
    dispatch = forwards * pp * hw.launch_s * _ops(FORWARD_OPS, shape, layout)
    c = pp * (_activation_s(shape, layout, wl, hw, tokens)
              + comm.seconds(hw, comm.tp(layout, shape, tokens, 2, 1)
                             + comm.ep(layout, shape, tokens, 2))) \
        + comm.seconds(hw, comm.pp(layout, shape, tokens, 1, False))
    seconds = _with_dispatch(max(flops / flops_s, b / bw) + c, dispatch, hw)
    return flops, b, flops / flops_s, b / bw, c, seconds, dispatch


POOL_POINTS = 1024  # rows a step admits in the partial-rollout replay; beyond, one stands for many
MEASURED_STEPS = 4  # steady-state steps the partial-rollout replay averages over


def _partial_totals(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware,
                    concurrent: int) -> tuple[list[float], float, float]:
    """One replica's mean step under partial rollouts (`partial_pool.pool_steps`, the
    runtime's rule): the chunk calls of each steady-state step, pending rows dealt evenly
    over the dp replicas; carried rows prefill their prompt and tokens so far again."""
    prompts = min(wl.prompts, max(1, POOL_POINTS // wl.samples))
    weight = wl.prompts / prompts / layout.dp  # a replica's rows per simulated row
    lengths = tuple(max(1, round(x)) for x in wl.response.spread(prompts * wl.samples * 8))
    warm = math.ceil(wl.response.max / wl.partial_tokens) + 1
    schedules = _pool_schedules(lengths, prompts, wl.samples, wl.partial_tokens, warm,
                                max(1, round(concurrent / weight)))
    totals, decode_steps, prefills = [0.0] * 7, 0.0, 0.0
    for calls in schedules:
        for call, sched in calls:
            part = _schedule_totals(sched, weight, shape, layout, wl, hw,
                                    sum(call.done) * weight)
            totals = [a + b / MEASURED_STEPS for a, b in zip(totals, part)]
            decode_steps += sched.decode_steps / MEASURED_STEPS
            prefills += len(sched.prefills) / MEASURED_STEPS
    return totals, decode_steps, prefills


@functools.lru_cache(maxsize=64)  # bounded: each step an interval draws has lengths of its own
def _pool(lengths: tuple[int, ...], prompts: int, k: int, tokens: int, warm: int) -> tuple:
    return tuple(pool_steps(list(lengths), prompts, k, tokens, warm + MEASURED_STEPS)[warm:])


@functools.lru_cache(maxsize=256)  # the layouts of one replica size share these
def _pool_schedules(lengths: tuple[int, ...], prompts: int, k: int, tokens: int, warm: int,
                    slots: int) -> tuple:  # each step's chunk calls, with their schedules
    return tuple(tuple((call, engine_schedule(list(call.new), slots, k, groups=list(call.groups),
                                              done=list(call.done))) for call in calls)
                 for calls in _pool(lengths, prompts, k, tokens, warm))


def _decode_weight_bytes(shape: ModelShape, layout: Layout, wl: Workload, live: float) -> float:
    """Weights read per decode step; a MoE layer reads only the experts its tokens select
    (expected distinct experts E (1 - (1 - k/E)^tokens))."""
    full = _weight_bytes(shape, layout, wl)
    if not shape.moe:
        return full
    e, k = shape.n_experts, shape.experts_per_token
    experts = shape.routed_params * wl.elem_bytes
    experts /= layout.tp * layout.pp * layout.ep
    touched = 1 - (1 - k / e) ** live
    return full - experts * (1 - touched)


def skipped(stage: str, role: str) -> StageCost:
    """A stage the algorithm does not run (generation in offline DPO)."""
    return StageCost(stage, role, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "not run")


def _infeasible(stage: str, role: str, need: float) -> StageCost:
    inf = float("inf")
    return StageCost(stage, role, 0.0, 0.0, inf, inf, inf, 0.0, inf, need,
                     "not even one rollout's KV cache fits")


def forward(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware, role: str,
            logits: bool = True, prompts_once: bool = False, trained: bool = False
            ) -> StageCost:
    """Teacher-forced forward over all rollouts (reference log-probs, reward or value scores);
    `prompts_once`: see `Workload.teacher_forced`; `trained`: the model is the one that
    trains there (the critic beside its training), in its training layout's wrappers."""
    seqs = math.ceil(wl.rollouts / layout.dp)
    tokens, m = wl.teacher_forced(seqs, prompts_once)
    mb_tokens, context = tokens / m, tokens / seqs
    flops = tokens * shape.forward_flops(context, logits)
    shards = layout.tp * layout.pp * layout.cp
    # as in `training`: the head whole on every TP and CP rank and the last stage, the last
    # CP rank's attention the most
    head = tokens * (shape.head_flops if logits else 2 * shape.hidden)
    busiest = ((flops - head + (layout.cp - 1) / layout.cp * tokens
                * shape.attention_flops(context)) / shards + head)
    compute_s = busiest / hw.flops(wl.dtype)
    # each of a micro-batch's pp pipeline micro-batches reads the stage's weights
    pieces = layout.pp
    memory_s = m * pieces * _weight_bytes(shape, layout, wl) / (hw.mem_bw * hw.mem_eff)
    # per-device layers (L / pp) already: each stage exchanges for its own layers
    comm_s = m * comm.seconds(hw, comm.tp(layout, shape, mb_tokens / layout.cp, 2, 1)
                              + comm.cp(layout, shape, mb_tokens, 1, False)
                              + comm.ep(layout, shape, mb_tokens / layout.cp, 2))
    comm_s += comm.seconds(hw, comm.pp(layout, shape, mb_tokens / pieces, m * pieces, False))
    host_s = (m * pieces * hw.stage_launch_s("assessment") * _ops(FORWARD_OPS, shape, layout)
              + m * _wrapper_s(hw, shape, layout, trained))
    act_s = _activation_s(shape, layout, wl, hw, tokens / layout.cp)
    act_s += _attention_s(shape, layout, wl, hw, tokens, context)
    work = (max(compute_s, memory_s) + act_s) * _bubble(layout)
    # ZeRO-3 gathers each layer's parameters for every micro-batch's forward
    dp_s = m * comm.Collective(
        "all_gather", layout.dp, layout.world_size,
        mem.PARAM_B * mem.params_per_device(shape, layout)).seconds(hw) \
        if layout.zero == 3 else 0.0
    dp_s += offload_copy_s(shape, layout, hw, m, trained=False)
    seconds = (_with_dispatch(work + comm_s, host_s, hw)
               + _exposed_dp(dp_s, work, shape.layers / layout.pp, hw))
    comm_s += dp_s
    memory_s += act_s
    rows = wl.micro_batch
    transient = mem.inference_bytes(shape, layout, rows * wl.max_context, logits, wl.max_context)
    return StageCost("assessment", role, flops * layout.dp, memory_s * hw.mem_bw * hw.mem_eff,
                     forward_depth(shape, wl.max_context), compute_s, memory_s, comm_s, seconds,
                     transient, dispatch_s=host_s)


def training(shape: ModelShape, layout: Layout, wl: Workload, hw: Hardware, role: str,
             logits: bool = True, prompts_once: bool = False) -> StageCost:
    """ppo_epochs passes of forward + backward, the DP gradient collectives and the AdamW
    update of each optimizer step (with an offloaded layout's copies and host-side update,
    `model_state`). FLOPs as the rehearsal counts them: the layers' matmuls 3 forwards' worth,
    +1 recomputed with checkpointing less the down projections (the recompute stops at the
    last tensor backward needs); flash attention 3.5 (its backward recomputes the
    scores: 5 matmuls to the forward's 2), +1; the output head at response positions only
    (`models.logprobs`), +1 when its chunks are recomputed. A LoRA actor (`wl.lora_rank`)
    skips the frozen weights' gradients: its matmuls and head take 2 forwards' worth, the
    adapters' own r/d-small work aside, and only the adapters' gradients are reduced."""
    ckpt = layout.activation_checkpointing
    lora = wl.lora_rank if role == "actor" else 0
    steps = wl.ppo_epochs * wl.minibatches
    mb_rows, tokens, m = wl.device_minibatch(layout.dp, prompts_once, layout.pp)
    per = math.ceil(mb_rows / m)
    padded = pipeline_rows(per, layout.pp) / per  # rows a pipeline repeats
    context = tokens / (mb_rows * padded)
    prompt_tokens = (wl.distinct_prompts(mb_rows) if prompts_once else mb_rows) * \
        wl.prompt_len * padded
    head_tokens = max(tokens - prompt_tokens, 0.0) if logits else 0.0
    recompute_head = head_tokens / (m * layout.pp) > mem.LOGIT_CHUNK  # per pipeline piece
    tokens, head_tokens = tokens * wl.minibatches, head_tokens * wl.minibatches
    passes = (3 if lora else 4) if ckpt else (2 if lora else 3)
    layers = tokens * ((2 if lora else 3) * shape.layer_matmul_flops()
                       # a LoRA down projection's adapter reads its input after the base
                       # matmul, so the recompute runs through it
                       + ckpt * (shape.layer_matmul_flops()
                                 - (0 if lora else shape.down_proj_flops()))
                       + (0 if logits else passes * 2 * shape.hidden))
    attention = tokens * (3.5 + ckpt) * shape.attention_flops(context)
    head = head_tokens * ((2 if lora else 3) + recompute_head) * shape.head_flops
    shards = layout.tp * layout.pp * layout.cp
    # the head is whole on every TP and CP rank (and on the last pipeline stage): each
    # computes all of it; the last CP rank's queries see every key, 2 - 1/cp of an even
    # share of attention, and it sets the pace
    flops = wl.ppo_epochs * (layers + attention + head * layout.tp * layout.cp)
    # the last pipeline stage, which holds all of the head, is the busiest
    device_flops = wl.ppo_epochs * ((layers + attention * (2 - 1 / layout.cp)) / shards + head)
    compute_s = device_flops / hw.flops(wl.dtype)
    pieces = layout.pp  # pipeline micro-batches per micro-batch (see `_bubble`)
    memory_s = (steps * m * pieces * passes * _weight_bytes(shape, layout, wl)
                / (hw.mem_bw * hw.mem_eff))
    comm_s = steps * comm.seconds(hw, comm.training(shape, layout, wl, role,
                                                    prompts_once)["model"])
    dp_s = steps * (comm.dp_comm(shape, layout, hw, m, lora)
                    + comm.seconds(hw, comm.cp_grads(shape, layout, lora))
                    + offload_copy_s(shape, layout, hw, m, trained=True, lora_rank=lora))
    # TP shards and FSDP2's wrappers leave DTensor parameters for clipping and AdamW
    dtensors = layout.tp > 1 or layout.dp > 1
    launch = hw.stage_launch_s("training")
    optimizer_op_s = launch + (hw.sharded_launch_s if dtensors else 0.0)
    per_pass = _ops(TRAIN_OPS, shape, layout) + ckpt * _ops(FORWARD_OPS, shape, layout)
    host_s = steps * (launch * m * pieces * per_pass
                      + optimizer_op_s * _ops(OPTIMIZER_OPS, shape, layout)
                      + m * _wrapper_s(hw, shape, layout, True))
    act_s = wl.ppo_epochs * ((TRAIN_ACTIVATION_PASSES + ckpt) * _activation_s(
        shape, layout, wl, hw, tokens / layout.cp)
        + (3 + ckpt) * _attention_s(shape, layout, wl, hw, tokens, context))
    work = (max(compute_s, memory_s) + act_s) * _bubble(layout)
    # the update runs after the last backward: nothing overlaps it
    update_s = steps * optimizer_s(shape, layout, hw, lora)
    seconds = (_with_dispatch(work + update_s + comm_s, host_s, hw)
               + _exposed_dp(dp_s, work, shape.layers / layout.pp, hw))
    comm_s += dp_s
    memory_s += act_s + update_s
    transient = mem.training_transient_bytes(
        shape, layout, pipeline_rows(wl.micro_batch, layout.pp) * wl.max_context, logits, lora,
        wl.max_context)
    depth = passes * forward_depth(shape, wl.max_context) + _log2(wl.tokens)
    return StageCost("training", role, flops * layout.dp, memory_s * hw.mem_bw * hw.mem_eff,
                     depth, compute_s, memory_s, comm_s, seconds, transient, dispatch_s=host_s)


def _exposed_dp(dp_s: float, work: float, layers: float, hw: Hardware) -> float:
    """The part of `dp_s` seconds of data-parallel collectives the layers' `work` does not
    hide: the first layer's gather (nothing runs before it), and what the overlapped share
    (`Hardware.dp_overlap`) of the rest exceeds the compute by."""
    hidden = hw.dp_overlap * dp_s * (1 - 1 / max(layers, 1))
    return dp_s - hidden + max(0.0, hidden - work)
