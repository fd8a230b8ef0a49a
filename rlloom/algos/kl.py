"""KL penalty pieces: per-token estimators, PPO's KL-shaped rewards and the KL coefficient."""
from __future__ import annotations

from typing import Callable

import torch

from rlloom.algos.masks import last_token, valid
from rlloom.algos.registry import Registry

# Bound on log-ratios fed to exp: e^20 is already far past any useful ratio, and the clamp
# keeps a stray padded or diverged token from producing inf (and then NaN gradients).
LOG_RATIO_CLAMP = 20.0

# fn(logp [n, T], ref_logp [n, T]) -> per-token KL estimate [n, T]
KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi - log ref: unbiased for KL(pi||ref) under pi samples, can be negative."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log pi - log ref)^2: biased, low variance, >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = ref/pi - log(ref/pi) - 1, log(ref/pi) clamped to +-20: unbiased and >= 0."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp() - log_ratio - 1


@torch.no_grad()
def kl_shaped_rewards(scores: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor,
                      ref_logp: torch.Tensor, coef: float, estimator: str) -> torch.Tensor:
    """PPO's per-token reward: -coef * kl_t on every valid token, + score_i on the last one.

    scores [n], mask/logp/ref_logp [n, T] -> token_rewards [n, T], zero on padding. The
    rewards are constants (no gradient). With coef = 0 only the score remains.
    """
    kl = KL_ESTIMATORS.get(estimator)(logp, ref_logp)
    rewards = torch.where(valid(mask), -coef * kl, 0)
    return rewards + torch.where(last_token(mask), scores[:, None].to(rewards.dtype), 0)


class AdaptiveKLController:
    """Proportional KL coefficient controller of Ziegler et al. 2019.

    error = clip(kl / target - 1, -0.2, 0.2); coef *= 1 + error * n_steps / horizon.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, "
                             f"got target={target}, horizon={horizon}")
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards the one that keeps `current_kl` at the target."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def kl_controller(kl_coef: float, kl_target: float | None, kl_horizon: int
                  ) -> "AdaptiveKLController | FixedKLController":
    """Adaptive toward `kl_target` when one is given, else the fixed `kl_coef`."""
    if kl_target is not None:
        return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
    return FixedKLController(kl_coef)


class FixedKLController:
    """A constant KL coefficient with the adaptive controller's interface."""

    def __init__(self, coef: float) -> None:
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""
