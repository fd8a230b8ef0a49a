"""Advantage estimators: per-sequence rewards -> per-token advantages."""
from __future__ import annotations

from typing import Callable

import torch

from rlloom.algos.registry import Registry

# fn(rewards [n], group_ids [n], response_mask [n, T]) -> advantages [n, T]
AdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")

GRPO_EPS = 1e-6


@ADVANTAGES.register("grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
         ) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-6), broadcast to every response token.

    The std is the unbiased sample std (divides by K-1), as in the DeepSeekMath paper's
    reference code; a group with identical rewards gets zero advantage.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group_ids.unique():
        idx = group_ids == g
        r = rewards[idx].float()
        adv[idx] = (r - r.mean()) / (r.std(unbiased=True) + GRPO_EPS)
    return adv[:, None] * response_mask
