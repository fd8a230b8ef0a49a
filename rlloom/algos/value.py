"""Critic loss for PPO."""
from __future__ import annotations

import torch

from rlloom.algos.masks import valid


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Per-token clipped value loss [n, T], zero on padding.

    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); 0.5 (V - R)^2 if clip is None.
    """
    keep = valid(mask)
    values, old_values, returns = (torch.where(keep, x, 0) for x in (values, old_values, returns))
    loss = (values - returns) ** 2
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped_values - returns) ** 2)
    return torch.where(keep, 0.5 * loss, 0)
