"""Masked tensor helpers shared by the estimators and losses: padding never leaks in."""
from __future__ import annotations

import torch


def valid(mask: torch.Tensor) -> torch.Tensor:
    """Bool view of a float response mask [n, T]."""
    return mask > 0


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """Bool [n, T]: True only at the last valid token of each row (none for an empty row)."""
    keep = valid(mask)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # positions are distinct, so the argmax over kept positions is unique.
    last = torch.where(keep, positions, -1).argmax(dim=-1, keepdim=True)
    return keep & (positions == last)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / (std + eps) over the valid entries of the whole batch; 0 elsewhere.

    The std is the population std (divides by the number of valid tokens N, not N-1): the
    batch is the whole population being normalised, and it stays defined for N = 1.
    """
    keep = valid(mask)
    n = keep.sum().clamp(min=1)
    x = torch.where(keep, x, 0)
    mean = x.sum() / n
    centred = torch.where(keep, x - mean, 0)
    std = (centred.pow(2).sum() / n).sqrt()
    return centred / (std + eps)
