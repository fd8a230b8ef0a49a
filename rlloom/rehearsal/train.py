"""Rehearse one rank's training or assessment micro-batch: rlloom's own model, layouts and
log-prob path at the plan's real shapes, on fake tensors (no memory is allocated and no
arithmetic is done) and, for a layout of several ranks, in a fake world of that size
(every collective returns at once).

What runs is what a GPU rank runs: fp32 weights and AdamW state with bf16 compute
(`train.compute_dtype: auto`: autocast, and data parallelism gathering bf16 weights),
`parallel.apply.parallelize` for the layout, `stages.batch.response_logprobs` for the
log-probs and entropies, AdamW from `parallel.apply.make_optimizer`. Attention runs the fused kernel with a mask's memory (see
`_gpu_attention`). What it cannot see: time, the allocator's rounding and fragmentation, and
kernels' own workspaces.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import multiprocessing
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import schedules
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias

from rlloom.models import transformer
from rlloom.models.config import FAMILY_TO_ARCH, ModelConfig
from rlloom.models.logprobs import token_logprobs
from rlloom.models.lora import PROJECTIONS, apply_lora
from rlloom.models.transformer import CausalLM
from rlloom.parallel import apply
from rlloom.parallel.data_parallel import before_backward, local_tensor
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.perf.model.shapes import ModelShape
from rlloom.rehearsal.comm import Collectives
from rlloom.rehearsal.flops import Flops
from rlloom.rehearsal.memory import PeakMemory
from rlloom.rehearsal.routing import even_routing
from rlloom.plan import Layout
from rlloom.rollout.generate import Rollout
from rlloom.runtime.ranks import RankGroup
from rlloom.runtime.stages.batch import joined, response_logprobs
from rlloom.runtime.stages.pipelined import padded_rows, pipeline_rows, pipelined_logprobs

T = TypeVar("T")


@dataclass(frozen=True)
class Rehearsed:
    """One rank's measured bytes and FLOPs of one training micro-batch (of several, each
    kind's most)."""
    params: int        # this rank's parameters (shards under ZeRO / TP)
    grads: int         # gradients after backward
    optimizer: int     # AdamW state after the step
    saved: int         # alive when forward ends: what backward will read (activations,
    #                    autocast's weight copies) and the loss
    peak: int          # the most bytes alive at once, the optimizer step included
    flops: float       # forward + backward FLOPs of the micro-batch on this rank
    sent: dict[str, float]  # bytes this rank sends in collectives, by kind, over the step
    collectives: int   # how many collectives it issues


def model_config(shape: ModelShape) -> ModelConfig:
    """The rlloom model config of a priced shape (gpt-oss with sinks and experts, Qwen3-MoE
    with experts, Qwen2 with QKV biases, OLMo2 with norms after the sublayers, Gemma2 with
    capped attention, GPT-2 with a plain MLP, DeepSeek-V3 with latent attention, Llama
    otherwise)."""
    family = ("deepseek_v3" if shape.latent else "gpt_oss" if shape.attn_sinks
              else "qwen3_moe" if shape.moe
              else "gpt2" if not shape.gated_mlp
              else "qwen2" if shape.qkv_bias else "olmo2" if shape.post_norms
              else "gemma2" if shape.attn_softcap else "llama")
    hf = {"architectures": [FAMILY_TO_ARCH[family]], "model_type": family,
          "vocab_size": shape.vocab, "hidden_size": shape.hidden,
          "intermediate_size": shape.ffn, "num_hidden_layers": shape.layers,
          "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
          "head_dim": shape.head_dim, "tie_word_embeddings": shape.tied_embeddings,
          "max_position_embeddings": shape.positions or 131072}
    if shape.attn_softcap:  # Gemma2's caps (its checkpoints': 50 and 30)
        hf.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                  query_pre_attn_scalar=shape.head_dim, hidden_activation="gelu_pytorch_tanh")
    if family == "gpt2":
        hf.update(n_inner=shape.ffn, activation_function="gelu_new")
    if family == "gpt_oss":  # its experts are intermediate_size wide; no window rehearsed
        hf.update(num_local_experts=shape.n_experts, num_experts_per_tok=shape.experts_per_token,
                  intermediate_size=shape.moe_ffn, layer_types=["full_attention"] * shape.layers,
                  rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    elif family == "deepseek_v3":  # one expert group: the grouping moves no bytes
        hf.update(qk_nope_head_dim=shape.head_dim - shape.rope_dim,
                  qk_rope_head_dim=shape.rope_dim, v_head_dim=shape.v_head_dim,
                  kv_lora_rank=shape.kv_lora_rank, q_lora_rank=shape.q_lora_rank or None,
                  n_routed_experts=shape.n_experts, num_experts_per_tok=shape.experts_per_token,
                  moe_intermediate_size=shape.moe_ffn, first_k_dense_replace=shape.dense_layers,
                  n_shared_experts=shape.shared_ffn // max(shape.moe_ffn, 1), n_group=1,
                  topk_group=1, attention_bias=shape.qkv_bias)
    elif shape.moe:
        hf.update(num_experts=shape.n_experts, num_experts_per_tok=shape.experts_per_token,
                  moe_intermediate_size=shape.moe_ffn, norm_topk_prob=True,
                  mlp_only_layers=list(range(shape.dense_layers)))
    return ModelConfig.from_hf(hf)


def _gpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                   enable_gqa: bool = False, scale: float | None = None) -> torch.Tensor:
    """What SDPA runs on a GPU for rlloom's attention: flash attention for causal packed rows
    and context-parallel shards (grouped KV heads as they are), and for a masked layer (a
    sliding window, or values narrower than the queries: latent attention) the
    memory-efficient kernel, which takes the mask as an additive bias in the compute dtype,
    made per call as SDPA converts a boolean mask. Both keep the output and its log-sum-exp
    for backward and have fake-tensor rules for both passes, which the CPU's kernels lack.
    Autocast casts SDPA's inputs; these aten ops are not on its list, so the cast is here."""
    if torch.is_autocast_enabled("cpu"):
        q, k, v = (x.to(torch.get_autocast_dtype("cpu")) for x in (q, k, v))
    if attn_mask is None or isinstance(attn_mask, CausalBias):  # a CausalBias: lower-right
        causal = is_causal or attn_mask is not None
        if v.shape[-1] != q.shape[-1]:  # latent attention's narrower values: flash takes
            # one head width; the memory-efficient kernel keeps the same for backward
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal,
                                                                  scale=scale)[0]
    bias = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
    b, h, s, _ = q.shape
    if enable_gqa:
        k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias.expand(b, h, s, k.shape[2]), True, scale=scale)[0]


def rehearsed_ranks(layout: Layout) -> list[int]:
    """The ranks a rehearsal runs: the first of every mesh dimension (`parallel.mesh`: pp, dp,
    cp, tp) but context parallelism's last, whose queries see every key (the most
    attention), on the first pipeline stage (the most micro-batches in flight) and the last
    (the head); at ZeRO-1 the first dp rank owns the largest parameter."""
    stage = layout.dp * layout.cp * layout.tp
    return sorted({s * stage + (layout.cp - 1) * layout.tp for s in (0, layout.pp - 1)})


@contextlib.contextmanager
def fake_world(size: int, rank: int = 0) -> Iterator[None]:
    """A process group of `size` ranks (this process is `rank`) whose collectives do
    nothing: torch's fake backend, for running a layout's code without its peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if size == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("rehearsal needs its own fake world; a process group is already "
                           "initialised in this process")
    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rollout(rows: int, prompt: int, response: int, vocab: int) -> Rollout:
    ids = torch.randint(0, vocab, (rows, prompt))
    out = torch.randint(0, vocab, (rows, response))
    return Rollout(ids, torch.ones(rows, prompt, dtype=torch.long), out,
                   torch.ones(rows, response, dtype=torch.long),
                   torch.zeros(rows, response), torch.ones(rows, dtype=torch.bool))


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this rank's parts of `tensors` (by their elements: FSDP's gradient shards
    are views of one buffer per layer)."""
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def rehearse_training(shape: ModelShape, layout: Layout, rows: int, prompt: int,
                      response: int, lora_rank: int = 0) -> Rehearsed:
    """`rehearsed_rank` of `layout` trains one micro-batch of `rows` sequences of `prompt` +
    `response` tokens: log-probs and entropies (`response_logprobs`), a policy-gradient
    loss, backward, and an AdamW step; with `lora_rank`, LoRA adapters on every projection
    (`model.lora`'s default targets) train and the base stays frozen."""
    runs = [_in_child(_rehearse_training, shape, layout, rank, rows, prompt, response,
                      lora_rank) for rank in rehearsed_ranks(layout)]
    # the busiest of them in each kind (a pipeline's first stage holds the most
    # activations, its last the head)
    return Rehearsed(**{f.name: max(getattr(r, f.name) for r in runs)
                        for f in dataclasses.fields(Rehearsed) if f.name != "sent"},
                     sent=max((r.sent for r in runs), key=lambda s: sum(s.values())))


def rehearse_scoring(shape: ModelShape, layout: Layout, rows: int, prompt: int,
                     response: int) -> int:
    """The peak bytes of `rehearsed_rank` of `layout` scoring one micro-batch with a model
    that does not train (the reference's log-probs): its weights and the forward's
    buffers."""
    return max(_in_child(_rehearse_scoring, shape, layout, rank, rows, prompt, response)
               for rank in rehearsed_ranks(layout))


def _in_child(fn: Callable[..., T], shape: ModelShape, layout: Layout, *args: int) -> T:
    """A layout of several ranks runs in a child process: its fake world and FSDP's hooks
    leave state behind that changed later rehearsals in the same process. Children fork
    from a server that imported this module once and ran nothing (0.04 s each, where a
    spawned interpreter importing torch took 5.1 s)."""
    if layout.world_size == 1:
        return fn(shape, layout, *args)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_readable, fn, shape, layout, *args).result()


def _readable(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a child, whose errors (some hold what pickling refuses) come back as
    their traceback's text."""
    try:
        return fn(*args)
    except Exception:
        raise RuntimeError(traceback.format_exc()) from None


@contextlib.contextmanager
def _rehearsed(layout: Layout, rank: int) -> Iterator[RankGroup]:
    """`rank` of the layout, its mesh and expert groups made (with real tensors) before the
    fake mode that the model is built and run under is entered; MoE routing even
    (`routing.even_routing`); a pipeline's schedule told its shapes are static (its warm-up
    reads a value its peers send)."""
    with fake_world(layout.world_size, rank):
        ranks = RankGroup(rank, layout.world_size)
        ranks.mesh(layout)
        if layout.ep > 1:
            ranks.experts(layout)  # its groups are read off the mesh's real tensor
        # FSDP over TP joins meshes, and a pipeline finds its end stages, off mesh tensors
        with FakeTensorMode(allow_non_fake_inputs=True), even_routing(), \
                mock.patch.object(DeviceMesh, "_concatenate",
                                  staticmethod(_real(DeviceMesh._concatenate))), \
                mock.patch.object(apply, "first_and_last_stages",
                                  _real(apply.first_and_last_stages)), \
                mock.patch.object(transformer, "causal_lower_right",
                                  _real(transformer.causal_lower_right)), \
                mock.patch.object(transformer.F, "scaled_dot_product_attention",
                                  _gpu_attention), \
                mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", _static_stages):
            yield ranks


def _real(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run outside the rehearsal's dispatch modes: it reads ranks off a device mesh's
    (real) tensor, or makes a `CausalBias`, a tensor subclass holding no data, which no
    mode can make."""
    from torch.utils._python_dispatch import _disable_current_modes

    def run(*args: object) -> T:
        with _disable_current_modes():
            return fn(*args)
    return run


def _static_stages(schedule: object, stages: list, has_backward: bool, p2p_done: bool) -> None:
    for stage in stages:
        stage._inference_mode = schedules.InferenceMode.STATIC


def _rehearse_training(shape: ModelShape, layout: Layout, rank: int, rows: int, prompt: int,
                       response: int, lora_rank: int) -> Rehearsed:
    with _rehearsed(layout, rank) as ranks:
        plain = CausalLM(model_config(shape))
        if lora_rank:
            apply_lora(plain, lora_rank, 2.0 * lora_rank, 0.0, PROJECTIONS, seed=0)
        # as a GPU rank with bf16 compute: fp32 weights and AdamW state, data parallelism
        # gathering bf16 weights
        model, optim = ranks.trained(plain, layout, 1e-6, torch.bfloat16)
        params = list(model.parameters())
        r = _rollout(rows, prompt, response, shape.vocab)
        with Collectives() as comm, Flops() as flops, PeakMemory() as mem:
            if isinstance(model, PipelinedModel):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    _pipelined_step(model, r)
                saved = mem.now  # the schedule interleaves forwards and backwards
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logp, entropy, _ = response_logprobs(model, r, 1.0, with_entropy=True)
                    loss = _loss(logp, entropy)
                saved = mem.now
                before_backward(model, last=True)
                loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
        with comm, PeakMemory() as step:
            # as the training stage finishes a step (`stages.online`), less the gradient
            # clipping, which reads its norm on the host (a scalar's collectives and bytes)
            ranks.share(layout).reduce(model)
            optim.step()
        state = [t for s in optim.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        optimizer = _local_bytes(state)
        p_bytes = _local_bytes(params)
        return Rehearsed(params=p_bytes, grads=_local_bytes(grads), optimizer=optimizer,
                         saved=saved,
                         # from the second step on the AdamW state is there throughout
                         peak=p_bytes + max(optimizer + mem.peak, mem.now + step.peak),
                         flops=flops.total, sent=dict(comm.sent),
                         collectives=sum(comm.count.values()))


def _loss(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """A policy-gradient loss with an entropy bonus: what backward reads of the log-probs."""
    return -(logp * torch.randn_like(logp)).mean() - 1e-3 * entropy.mean()


def _pipelined_step(pipe: PipelinedModel, r: Rollout) -> None:
    """The micro-batch through the pipeline's 1F1B schedule, as `stages.pipelined` runs it:
    rows repeated up to a multiple of its micro-batches, the head in the loss."""
    ids, mask, span = joined(r)
    rows = pipeline_rows(pipe, len(ids))
    ids, mask, tokens = (padded_rows(x, rows) for x in (ids, mask, r.response_ids))

    def loss_fn(hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return _loss(*token_logprobs(pipe.module.lm_head, hidden[:, span], tokens, 1.0, True))
    pipe.train_step(ids, mask, tokens, loss_fn)


def _rehearse_scoring(shape: ModelShape, layout: Layout, rank: int, rows: int, prompt: int,
                      response: int) -> int:
    with _rehearsed(layout, rank) as ranks:
        model = ranks.frozen(frozen_bf16(shape), layout)
        held = _local_bytes(list(model.parameters()))
        r = _rollout(rows, prompt, response, shape.vocab)
        with PeakMemory() as mem, torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            if isinstance(model, PipelinedModel):
                pipelined_logprobs(model, r, 1.0)
            else:
                response_logprobs(model, r, 1.0)
        return held + mem.peak


def frozen_bf16(shape: ModelShape) -> CausalLM:
    """A model that does not train, held in the compute dtype as `runtime.device.frozen_dtype`
    holds it on a GPU (made in it: converting fake parameters after the fact is refused)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return CausalLM(model_config(shape)).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
