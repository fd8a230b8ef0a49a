"""DAPO's data-side pieces (Yu et al. 2025): dynamic-sampling filter, soft overlong penalty."""
from __future__ import annotations

import torch


def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Bool [n]: True where the sample's group does not have all-equal scores.

    A group whose scores are all equal has zero group-relative advantage, so dynamic
    sampling drops it and keeps these.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    lo = torch.full((n_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    hi = torch.full((n_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    lo = lo.scatter_reduce(0, inverse, scores, reduce="amin")
    hi = hi.scatter_reduce(0, inverse, scores, reduce="amax")
    return (hi > lo)[inverse]


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """Soft overlong punishment [n], added to the score of each response of length L.

    0 if L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len inside the last
    cache_len tokens (from 0 down to -1); -1 beyond max_len.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, "
                         f"max_len={max_len}")
    soft_start = max_len - cache_len
    lengths = lengths.to(torch.get_default_dtype())
    # cache_len = 0 has no soft zone; max(., 1) only keeps the unused branch finite.
    soft = (soft_start - lengths) / max(cache_len, 1)
    penalty = torch.where(lengths <= soft_start, 0.0, soft)
    return torch.where(lengths > max_len, -1.0, penalty)
