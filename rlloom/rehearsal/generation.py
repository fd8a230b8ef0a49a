"""Rehearse one generation rank at the plan's concurrency and context: rlloom's own engine
code on fake tensors, as a GPU rank runs it (weights in bf16, as `hosts.copy_dtype` holds a
generation copy; decode projections unfused, as `engine_forward.fuses` decides on a GPU).

One replica of `slots` rollouts of `prompt` + `response` positions, at the moment that holds
the most: the KV cache at its full capacity (the end of a long rollout), one prefill forward
at the engine's token budget whose prompts' keys are placed into slots (a refill), then a
decode step over every slot reading every position, and its sampling. A tensor-parallel
replica runs the engine's plain loop (`rollout.engine.Engine`): a wave of `slots` rows
prefilled together into its own cache, then a decode step at the cache's last position.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch

from rlloom.models.cache import KVCache
from rlloom.models.transformer import CausalLM, kv_dtype, local_kv_heads
from rlloom.perf.model.memory import PREFILL_TOKENS
from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Layout
from rlloom.rehearsal.memory import PeakMemory
from rlloom.rehearsal.train import _in_child, _local_bytes, _rehearsed, frozen_bf16
from rlloom.rollout import engine_forward
from rlloom.rollout.engine import EngineConfig, _Run
from rlloom.rollout.engine_forward import decode_forward, prefill_forward
from rlloom.rollout.generate import outputs, step_logits
from rlloom.rollout.sampling import SamplingParams, sample_with_uniforms


@dataclass(frozen=True)
class RehearsedGeneration:
    """One generation rank's bytes: its weights, its KV cache and the most alive at once."""
    weights: int
    kv: int
    peak: int


def rehearse_generation(shape: ModelShape, tp: int, slots: int, rollouts: int, prompt: int,
                        response: int, samples: int = 1, prefill_tokens: int = PREFILL_TOKENS
                        ) -> RehearsedGeneration:
    """Rank 0 of a replica sharded over `tp` (its ranks hold equal shares) generating
    `rollouts` with `slots` of them at once, each prompt shared by `samples` of them."""
    return _in_child(_rehearse_generation, shape, Layout(tp=tp), 0, slots, rollouts, prompt,
                     response, samples, prefill_tokens)


def _rehearse_generation(shape: ModelShape, layout: Layout, rank: int, slots: int,
                         rollouts: int, prompt: int, response: int, samples: int,
                         prefill_tokens: int) -> RehearsedGeneration:
    with _rehearsed(layout, rank) as ranks, \
            mock.patch.object(engine_forward, "fuses", lambda weight: False):
        model = ranks.generating(frozen_bf16(shape), layout)
        weights = _local_bytes(list(model.parameters()))
        with torch.no_grad(), PeakMemory() as mem:
            if layout.tp > 1 or shape.latent:  # the engine's plain loop, as it runs them
                kv = _plain_wave(model, slots, rollouts, prompt, response)
            else:
                kv = _engine_refill(model, slots, rollouts, prompt, response, samples,
                                    prefill_tokens)
        return RehearsedGeneration(weights, kv, weights + mem.peak)


def _sample(logits: torch.Tensor) -> torch.Tensor:
    u = torch.rand(logits.shape[0])
    return sample_with_uniforms(logits, SamplingParams(temperature=1.0), u)[0]


def _engine_refill(model: CausalLM, slots: int, rollouts: int, prompt: int, response: int,
                   samples: int, prefill_tokens: int) -> int:
    """The engine's state for `rollouts` sequences (`engine._Run`, greedy: its seed is a
    value) with its `slots` grown to the longest context, a prefill forward of as many
    prompts as its token budget takes (a refill: at most one per `samples` slots) placed into
    slots, then a decode step over all of them; returns the cache's bytes."""
    config = EngineConfig(max_batch=slots, prefill_tokens=prefill_tokens, n_samples=samples,
                          kv_chunk=prompt + response)
    run = _Run(model, [[1] * prompt] * rollouts, SamplingParams(response, 0.0), 2, 0, None,
               config, None, None)
    kv = _local_bytes(run.cache.k + run.cache.v)
    groups = max(1, min(-(-slots // samples), prefill_tokens // prompt))
    batch = prefill_forward(model, torch.ones(groups, prompt, dtype=torch.long),
                            torch.full((groups,), prompt), run.ropes)
    rows = min(slots, groups * samples)
    run.cache.place(torch.arange(rows), batch.k, batch.v, torch.arange(rows) // samples)
    _sample(batch.logits)
    del batch
    full = torch.full((slots,), prompt + response - 1)
    _sample(decode_forward(model, run.fused, run.cache, run.next_tok, full, run.held + 1,
                           prompt + response, run.ropes))
    return kv


def _plain_wave(model: CausalLM, rows: int, rollouts: int, prompt: int, response: int) -> int:
    """The plain loop's last wave of `rows`, every wave's outputs held: its prefill into a
    cache of the longest context, then a decode step at its last position; returns the
    cache's bytes."""
    c, max_len = model.config, prompt + response
    _ = outputs(rollouts, response, 0, "cpu")  # alive to the end, as the earlier waves' are
    cache = KVCache(c, rows, max_len, kv_dtype(model), "cpu", local_kv_heads(model))
    kv = _local_bytes(cache.k + cache.v)
    ids = torch.randint(0, c.vocab_size, (rows, prompt))
    tokens = _sample(step_logits(model, ids, torch.ones_like(ids), cache))
    cache.length = max_len - 1
    _sample(step_logits(model, tokens[:, None], torch.ones(rows, 1, dtype=torch.long), cache))
    return kv
