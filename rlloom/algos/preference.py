"""Offline preference losses (DPO, IPO) on summed sequence log-probs."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from rlloom.algos.registry import Registry

# fn(policy_chosen, policy_rejected, ref_chosen, ref_rejected [pairs], beta) -> loss [pairs]
PreferenceLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss")


def _margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
            ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> torch.Tensor:
    """h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))  # [pairs]."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


@PREFERENCE_LOSSES.register("dpo")
def dpo(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * h)."""
    return -F.logsigmoid(beta * _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected))


@PREFERENCE_LOSSES.register("ipo")
def ipo(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1 / (2 beta))^2, regressing the margin to a fixed target."""
    if beta <= 0:
        raise ValueError(f"ipo needs beta > 0, got {beta}")
    h = _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return (h - 1 / (2 * beta)) ** 2


def preference_accuracy(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                        ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs whose implicit reward beta (log pi - log ref) ranks chosen first.

    beta > 0 does not change the ranking, so it is not an argument. Returns a scalar.
    """
    h = _margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return (h > 0).to(policy_chosen.dtype).mean()
