"""Tokenising prompts and scoring token sequences with a model."""
from __future__ import annotations

import torch

from rlloom.models.transformer import CausalLM
from rlloom.rollout.sampling import policy_logprobs


def response_logprobs(model: CausalLM, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      response_ids: torch.Tensor, response_mask: torch.Tensor,
                      temperature: float, with_entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [n, T] of the response tokens (and entropies [n, T]) under `model`.

    The layout (left-padded prompt, right-padded response) is the one generation used, so
    positions and numerics match the log-probs recorded while sampling.
    """
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1)
    p, t = prompt_ids.shape[1], response_ids.shape[1]
    logits = model(ids, mask)[:, p - 1:p + t - 1]
    logp_all = policy_logprobs(logits, temperature)                 # [n, T, V]
    logp = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
