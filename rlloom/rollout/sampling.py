"""Turning next-token logits into a sampled token and its log-probability."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 disables top-k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs of the policy the trainer optimises: softmax(logits / temperature).

    top-k / top-p only shape what is sampled; the importance ratio is taken against the
    tempered, untruncated distribution, the same one the trainer recomputes.
    """
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch] and their policy log-probs [batch] from logits [batch, vocab]."""
    logp = policy_logprobs(logits, params.temperature)
    if params.greedy:
        tokens = logp.argmax(-1)
    else:
        filtered = logp.clone()
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
        tokens = torch.multinomial(filtered.softmax(-1), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
