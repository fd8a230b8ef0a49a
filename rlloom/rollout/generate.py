"""Batched autoregressive generation with a KV cache."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch

from rlloom.models.cache import KVCache
from rlloom.models.moe import routing
from rlloom.models.embeddings import check_positions
from rlloom.models.transformer import CausalLM, kv_dtype, local_kv_heads
from rlloom.rollout.routes import RouteLog, pad_routes
from rlloom.rollout.sampling import (
    Decode,
    SamplingParams,
    StopMatcher,
    sample,
    sample_with_uniforms,
    seen_tokens,
)


@dataclass
class Rollout:
    prompt_ids: torch.Tensor    # [n, prompt_len], left-padded with pad_id
    prompt_mask: torch.Tensor   # [n, prompt_len], 1 for real tokens
    response_ids: torch.Tensor  # [n, resp_len], right-padded with pad_id; includes EOS if hit
    response_mask: torch.Tensor # [n, resp_len]
    logprobs: torch.Tensor      # [n, resp_len], policy log-prob of each response token
    finished: torch.Tensor      # [n] bool, True where EOS was generated
    # [n, resp_len] 1 where a tool's result was inserted into the response: read by the model,
    # never trained on (no loss, no KL); None: every response token was sampled
    injected: torch.Tensor | None = None
    # [n, prompt_len + resp_len, MoE layers, k] experts each token was routed to while
    # generated (rollout/routes.py; routing replay), -1 where none; None: not recorded
    routes: torch.Tensor | None = None

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(1)

    @property
    def action_mask(self) -> torch.Tensor:
        """[n, resp_len] the sampled tokens: what losses, KL and advantages count."""
        if self.injected is None:
            return self.response_mask
        return self.response_mask * (1 - self.injected)

    def select(self, idx: torch.Tensor) -> "Rollout":
        return Rollout(*(maybe(lambda v: v[idx], getattr(self, f.name)) for f in fields(self)))

    def to(self, device: torch.device | str) -> "Rollout":
        return Rollout(*(maybe(lambda v: v.to(device), getattr(self, f.name))
                         for f in fields(self)))


def maybe(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor | None
          ) -> torch.Tensor | None:
    """`fn(x)`, or None for an optional tensor that is absent."""
    return None if x is None else fn(x)


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Rows of several rollouts in one, re-padded to the widest prompt and response."""
    p = max(r.prompt_ids.shape[1] for r in parts)
    t = max(r.response_ids.shape[1] for r in parts)

    def pad(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - x.shape[1]
        return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),
        torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),
        torch.cat([pad(r.response_ids, t, pad_id, False) for r in parts]),
        torch.cat([pad(r.response_mask, t, 0, False) for r in parts]),
        torch.cat([pad(r.logprobs, t, 0.0, False) for r in parts]),
        torch.cat([r.finished for r in parts]),
        None if all(r.injected is None for r in parts) else torch.cat(
            [pad(r.injected if r.injected is not None else torch.zeros_like(r.response_mask),
                 t, 0, False) for r in parts]),
        None if any(r.routes is None for r in parts) else torch.cat(
            [pad_routes(r.routes, p, t, r.prompt_ids.shape[1]) for r in parts]))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


@torch.no_grad()
def generate(model: CausalLM, prompts: list[list[int]], params: SamplingParams, eos_id: int,
             pad_id: int, generator: torch.Generator | None = None,
             use_cache: bool = True, decode: Decode | None = None,
             record_routes: bool = False) -> Rollout:
    """Sample up to `max_new_tokens` for each prompt, stopping rows at EOS or a stop (token
    ids or, with `decode`, strings: kept in the response, counted as finished);
    `record_routes`: with each token's experts (an MoE model, with the cache).

    Without the cache every step re-runs the whole prefix; it exists to check the cache.
    The rollout is on the model's device. Every step samples every row (finished ones are
    masked), so the random stream does not depend on when rows end.
    """
    if record_routes and not use_cache:
        raise ValueError("record_routes needs use_cache: each pass must feed the new tokens")
    stops = StopMatcher(params, decode)
    dev = next(model.parameters()).device
    prompt_ids, prompt_mask = (x.to(dev) for x in left_pad(prompts, pad_id))
    n, t_max, width = len(prompts), params.max_new_tokens, prompt_ids.shape[1]
    check_positions(model.config, width, t_max)
    cache = (KVCache(model.config, n, width + t_max, kv_dtype(model), dev,
                     local_kv_heads(model)) if use_cache else None)
    # [n, vocab]: the tokens each sequence holds, for a repetition penalty
    seen = (seen_tokens(prompts, model.config.vocab_size, dev)
            if params.repetition_penalty != 1.0 else None)
    with routing(model) if record_routes else nullcontext() as routes:
        log = RouteLog(model, routes, n, width + t_max, dev) if record_routes else None
        ids, mask, lp, live = _steps(model, prompt_ids, prompt_mask, params, eos_id, pad_id,
                                     generator, use_cache, stops, cache, seen, log)
    used = int(mask.sum(0).nonzero().max()) + 1
    return Rollout(prompt_ids, prompt_mask, ids[:, :used], mask[:, :used], lp[:, :used],
                   ~live, routes=None if log is None else log.log[:, :width + used])


def _steps(model: CausalLM, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
           params: SamplingParams, eos_id: int, pad_id: int,
           generator: torch.Generator | None, use_cache: bool, stops: StopMatcher,
           cache: KVCache | None, seen: torch.Tensor | None, log: RouteLog | None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`generate`'s decode loop over the left-padded prompts: response ids, mask, log-probs
    and which rows are live."""
    n, width = prompt_ids.shape
    t_max, dev = params.max_new_tokens, prompt_ids.device
    tails: list[list[int]] = [[] for _ in range(n)]
    out_ids, out_mask, out_lp = outputs(n, t_max, pad_id, dev)
    live = torch.ones(n, dtype=torch.bool, device=dev)
    step_ids, step_mask = prompt_ids, prompt_mask
    for t in range(t_max):
        if use_cache:
            logits = step_logits(model, step_ids, step_mask, cache)
            if log is not None and t == 0:
                routed = log.taken().view(n, width, log.layers, log.k)
                log.log[:, :width] = routed.masked_fill(~prompt_mask.bool()[..., None, None],
                                                        -1)
            elif log is not None:  # the token fed: response token t - 1 of the live rows
                log.log[step_mask[:, 0].bool(), width + t - 1] = \
                    log.taken()[step_mask[:, 0].bool()]
        else:
            logits = step_logits(model, torch.cat([prompt_ids, out_ids[:, :t]], 1),
                                 torch.cat([prompt_mask, out_mask[:, :t]], 1))
        tokens, lp = _sample(logits, params, generator, seen)
        tokens = torch.where(live, tokens, pad_id)
        if seen is not None:
            seen[live, tokens[live]] = True
        out_ids[:, t] = tokens
        out_mask[:, t] = live.long()
        out_lp[:, t] = torch.where(live, lp, 0.0)
        if stops:  # one host sync per step: the plain loop is the reference path
            was_live = live.tolist()
            for r, tok in enumerate(tokens.tolist()):
                if was_live[r]:
                    tails[r].append(tok)
                    if stops.hit(tails[r]):
                        live[r] = False
        live = live & (tokens != eos_id)
        if not live.any():
            break
        step_ids, step_mask = tokens[:, None], live.long()[:, None]
    return out_ids, out_mask, out_lp, live


def outputs(rows: int, t_max: int, pad_id: int, device: torch.device | str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain loop's outputs for `rows`: token ids, their mask and their log-probs."""
    return (torch.full((rows, t_max), pad_id, dtype=torch.long, device=device),
            torch.zeros(rows, t_max, dtype=torch.long, device=device),
            torch.zeros(rows, t_max, device=device))


def step_logits(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
    """The next token's logits [rows, V] after `ids`."""
    return model(ids, mask, cache, last=True)[:, -1]


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
            seen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`; a generator on another device than the logits (the trainer's CPU generator
    with a model on a GPU) draws the uniforms on its own device, which then move."""
    if generator is None or params.greedy or generator.device == logits.device:
        return sample(logits, params, generator, seen)
    u = torch.rand(logits.shape[0], generator=generator, device=generator.device)
    return sample_with_uniforms(logits, params, u.to(logits.device), seen)
