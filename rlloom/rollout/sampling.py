"""Turning next-token logits into a sampled token and its log-probability."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 disables top-k
    min_p: float = 0.0           # drop tokens below min_p * the top token's probability
    # above 1, tokens already in the sequence (prompt and response) are made less likely:
    # their logit divided by it when positive, multiplied when negative (CTRL; transformers'
    # and vLLM's rule), before temperature
    repetition_penalty: float = 1.0
    # Stops end a sequence like EOS (it counts as finished) and stay in the response, since
    # the trainer needs every sampled token. Token stops match the response's last ids; text
    # stops need a decode callback (the engine's `decode`).
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


Decode = Callable[[list[int]], str]


class StopMatcher:
    """Whether a response, given its newest ids, now ends with a stop token sequence or
    contains a stop string (decoded over a window of its last ids: a stop string spans at
    most its own length in tokens, each at least one character)."""

    def __init__(self, params: SamplingParams, decode: Decode | None) -> None:
        if params.stop and decode is None:
            raise ValueError("stop strings need a `decode` callback (token ids -> text)")
        self.ids = [list(s) for s in params.stop_token_ids if s]
        self.strings, self.decode = params.stop, decode
        self.window = 2 * max((len(s) for s in params.stop), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.ids or self.strings)

    def hit(self, tail: list[int]) -> bool:
        if any(tail[-len(s):] == s for s in self.ids):
            return True
        return bool(self.strings) and any(s in self.decode(tail[-self.window:])
                                          for s in self.strings)


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the policy the trainer optimises: softmax(logits / temperature).

    top-k / top-p only shape what is sampled; the importance ratio is taken against the
    tempered, untruncated distribution, the same one the trainer recomputes.
    """
    logits = logits.float()
    if temperature and temperature != 1.0:  # x / 1 is x: no copy of the logits for it
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def seen_tokens(prompts: list[list[int]], vocab: int, device: torch.device | str,
                rows: int | None = None) -> torch.Tensor:
    """[rows, vocab] bool (rows: one per prompt by default): the tokens each prompt holds, the
    start of what a repetition penalty counts as seen."""
    seen = torch.zeros(rows or len(prompts), vocab, dtype=torch.bool, device=device)
    for i, q in enumerate(prompts):
        seen[i, torch.tensor(q, dtype=torch.long, device=device)] = True
    return seen


def _shaped(logits: torch.Tensor, logp: torch.Tensor, params: SamplingParams,
            seen: torch.Tensor | None) -> torch.Tensor:
    """The tempered log-probs that sampling draws from: `logp`, or with a repetition penalty
    those of the penalised logits (seen [batch, vocab] bool: tokens already in the sequence).
    Like top-k and top-p, the penalty only shapes what is sampled: the log-prob recorded is
    the policy's, which the trainer recomputes."""
    if params.repetition_penalty == 1.0:
        return logp
    if seen is None:
        raise ValueError("a repetition penalty needs the tokens each sequence has seen")
    x = logits.float()
    penalised = torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    return policy_logprobs(torch.where(seen, penalised, x), params.temperature)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch] and their policy log-probs [batch] from logits [batch, vocab];
    `seen` [batch, vocab] bool is needed with a repetition penalty."""
    logp = policy_logprobs(logits, params.temperature)
    shaped = _shaped(logits, logp, params, seen)
    if params.greedy:
        tokens = shaped.argmax(-1)
    else:
        filtered = shaped.clone()
        if params.top_k > 0:
            kth = filtered.topk(min(params.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
            filtered[filtered < kth] = float("-inf")
        if params.top_p < 1.0:
            sorted_lp, order = filtered.sort(dim=-1, descending=True)
            cum = sorted_lp.softmax(-1).cumsum(-1)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            drop_sorted = cum - sorted_lp.softmax(-1) >= params.top_p
            filtered = filtered.scatter(-1, order, sorted_lp.masked_fill(drop_sorted,
                                                                         float("-inf")))
        if params.min_p > 0.0:
            # ratios to the top token survive renormalisation, so this equals min-p on the
            # top-k / top-p renormalised distribution
            floor = filtered.max(-1, keepdim=True).values + math.log(params.min_p)
            filtered = filtered.masked_fill(filtered < floor, float("-inf"))
        tokens = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sample_with_uniforms(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor,
                         seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` by inverting the CDF at given uniforms u [batch] in [0, 1).

    The same distribution as `sample`, but each row's draw depends only on its own uniform,
    not on which other rows share the batch: the engine gives every (sequence, step) a
    uniform drawn up front, so its output does not depend on slot scheduling.
    """
    logp = policy_logprobs(logits, params.temperature)         # [batch, vocab]
    shaped = _shaped(logits, logp, params, seen)
    if params.greedy:
        tokens = shaped.argmax(-1)
    elif params.top_p < 1.0 or params.top_k > 0:
        if params.top_p < 1.0:
            weights, order = shaped.exp().sort(-1, descending=True)
            if params.top_k > 0:
                weights, order = weights[:, :params.top_k], order[:, :params.top_k]
        else:
            weights, order = shaped.exp().topk(min(params.top_k, logp.shape[-1]), -1)
        if params.top_p < 1.0:
            cum = weights.cumsum(-1)
            # mass before a token reaching top_p of the (top-k renormalised) total drops it
            weights = weights.masked_fill(cum - weights >= params.top_p * cum[:, -1:], 0.0)
        if params.min_p > 0.0:
            weights = weights.masked_fill(weights < params.min_p * weights[:, :1], 0.0)
        tokens = order.gather(-1, _invert_cdf(weights, u)[:, None]).squeeze(-1)
    else:
        weights = shaped.exp()
        if params.min_p > 0.0:
            weights = weights.masked_fill(
                weights < params.min_p * weights.max(-1, keepdim=True).values, 0.0)
        tokens = _invert_cdf(weights, u)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _invert_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [batch] of the first weight whose cumulative sum exceeds u * total.

    The target is kept strictly below the total so rounding can never pick a zero-weight
    tail entry; a zero weight never owns a cumulative step, so it is never chosen.
    """
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.dtype) * total,
                           torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x [..] int64 in [0, 2**32), in halves so int64 never overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 32-bit integer hash (Wellons' lowbias32) of x in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed: int, seq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """u [rows] in [0, 1), 24 bits like float32 `torch.rand`, for sequences seq [rows] at
    steps step [rows]: a hash of (seed, sequence, step), so each is drawn once and for all
    whatever slot or batch the sequence runs in, without a table of n x max_new_tokens."""
    h = _hash32(_mul32(seq & _M32, 0x9E3779B1) ^ (seed & _M32))
    h = _hash32((h + _mul32(step & _M32, 0x85EBCA77)) & _M32)
    return (h >> 8).float() * 2.0 ** -24
