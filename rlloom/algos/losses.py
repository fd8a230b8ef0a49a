"""Policy losses, KL estimators and loss aggregation: pure tensor functions."""
from __future__ import annotations

from typing import Callable

import torch

from rlloom.algos.registry import Registry

KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry(
    "KL estimator")
AGGREGATIONS: Registry[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = Registry(
    "loss aggregation")
POLICY_LOSSES: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry(
    "policy loss")

# log-ratio clamp of the k3 estimator: exp(20) is already far beyond any useful penalty.
K3_LOG_RATIO_CLAMP = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log pi - log ref: unbiased, high variance, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 (log pi - log ref)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """ref/pi - log(ref/pi) - 1: unbiased for KL(pi||ref) under pi samples, always >= 0."""
    log_ratio = (ref_logp - logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return log_ratio.exp() - log_ratio - 1


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, total_tokens: float) -> torch.Tensor:
    """Sum of token losses / `total_tokens`, the token count of the whole mini-batch.

    Passing the mini-batch count (not this micro-batch's) keeps gradients identical however
    the mini-batch is split into micro-batches or ranks.
    """
    return (loss * mask).sum() / total_tokens


@POLICY_LOSSES.register("ppo")
def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate -min(r A, clip(r, 1-low, 1+high) A) and clipped flags."""
    ratio = (logp - old_logp).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)
