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
    """(x - mean) / sqrt(var + eps) over the valid entries of the whole batch; 0 elsewhere.

    The variance is the population variance (divides by the number of valid tokens N, not
    N-1): the batch is the whole population being normalised, and it stays defined for N = 1.
    The mean is taken relative to the first valid entry, so a constant batch whitens to
    exactly 0 (an offset of a few ulps would otherwise be scaled by 1/sqrt(eps))."""
    keep = valid(mask)
    n = keep.sum().clamp(min=1)
    wide = x.double()  # squares of large returns overflow float32 (and the variance with them)
    first = wide.flatten()[keep.flatten().to(torch.uint8).argmax()]
    offset = torch.where(keep, wide - first, 0)
    centred = torch.where(keep, offset - offset.sum() / n, 0)
    return (centred * torch.rsqrt(centred.pow(2).sum() / n + eps)).to(x.dtype)
