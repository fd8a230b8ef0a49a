"""Policy-gradient losses (PPO and its relatives); the entropy is `models.logprobs`'s.

Each loss returns (loss [n, T] per token, clipped [n, T] bool); both are zero/False on
padding, and padded inputs get exactly zero gradient whatever values they hold. The
per-token loss still has to be aggregated (see `aggregation.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import torch

from rlloom.algos.kl import LOG_RATIO_CLAMP
from rlloom.algos.masks import valid
from rlloom.algos.registry import Registry

if TYPE_CHECKING:
    from rlloom.config import AlgoSection


@dataclass
class PolicyLossConfig:
    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high; DAPO's clip-higher sets it above low
    dual_clip: float | None = None  # c > 1: for A < 0 cap the loss at -c A (Ye et al. 2020)
    # CISPO caps its detached IS weight at 1 + cispo_clip_high and sets no floor, as MiniMax-M1
    # does; 3.0 caps the weight at 4, the cap used by public CISPO recipes.
    cispo_clip_high: float = 3.0

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low <= 1 or self.clip_high < 0:
            raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got "
                             f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {self.dual_clip}")
        if self.cispo_clip_high < 0:
            raise ValueError(f"cispo_clip_high must be >= 0, got {self.cispo_clip_high}")

    @classmethod
    def from_algo(cls, algo: AlgoSection) -> PolicyLossConfig:
        """The clip settings of a run's `algo` section: every field here is a field there of
        the same name, so a new setting cannot be left out where the runtime builds this."""
        return cls(**{f.name: getattr(algo, f.name) for f in fields(cls)})


class PolicyLoss(Protocol):
    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, cfg: PolicyLossConfig,
                 prox_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _zero_padding(mask: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Replace padded entries by 0 up front: nothing non-finite can reach exp or a gradient."""
    keep = valid(mask)
    return [torch.where(keep, x, 0) for x in xs]


def _ratio(logp: torch.Tensor, base_logp: torch.Tensor) -> torch.Tensor:
    return (logp - base_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1-low, 1+high) A), then the dual clip for A < 0 if configured.

    `where` rather than `minimum` so a clipped token gets exactly zero gradient.
    """
    unclipped = ratio * adv
    clipped_obj = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    clipped = clipped_obj < unclipped
    loss = -torch.where(clipped, clipped_obj, unclipped)
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return loss, clipped


def _finish(loss: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    keep = valid(mask)
    return torch.where(keep, loss, 0), clipped & keep


@POLICY_LOSSES.register("ppo")
def ppo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, cfg: PolicyLossConfig, prox_logp: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip: -min(r A, clip(r, 1-low, 1+high) A), r = exp(logp - old_logp).

    With dual_clip c, a token with A < 0 has its loss capped at -c A (Ye et al. 2020).
    `prox_logp` is ignored.
    """
    logp, old_logp, adv = _zero_padding(mask, logp, old_logp, advantages)
    return _finish(*_clipped_surrogate(_ratio(logp, old_logp), adv, cfg), mask)


@POLICY_LOSSES.register("gspo")
def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, cfg: PolicyLossConfig, prox_logp: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token (Zheng et al. 2025), clipped like ppo with the sequence ratio.

    s_i = exp(mean over valid t of (logp - old_logp)); the token ratio is
    s_it = sg[s_i] * exp(logp - sg[logp]): value s_i, gradient s_i * grad log pi(y_t).
    GSPO's paper uses far tighter clip ranges than PPO (around 3e-4 / 4e-4).
    """
    logp, old_logp, adv = _zero_padding(mask, logp, old_logp, advantages)
    n_tokens = valid(mask).sum(dim=-1).clamp(min=1)
    seq_log_ratio = (logp - old_logp).sum(dim=-1) / n_tokens
    seq_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().detach()
    ratio = seq_ratio[:, None] * (logp - logp.detach()).exp()
    return _finish(*_clipped_surrogate(ratio, adv, cfg), mask)


@POLICY_LOSSES.register("cispo")
def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, cfg: PolicyLossConfig, prox_logp: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1 2025): -sg[min(r, 1 + cispo_clip_high)] A log pi.

    The IS weight is detached and capped but never zeroes a token, so every token keeps a
    gradient (through log pi only). `clipped` marks tokens whose weight hit the cap.
    """
    logp, old_logp, adv = _zero_padding(mask, logp, old_logp, advantages)
    ratio = _ratio(logp, old_logp).detach()
    cap = 1 + cfg.cispo_clip_high
    loss = -ratio.clamp(max=cap) * adv * logp
    return _finish(loss, ratio > cap, mask)


@POLICY_LOSSES.register("decoupled_ppo", needs={"prox_logp"})
def decoupled_ppo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, cfg: PolicyLossConfig,
                  prox_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO (Hilton et al. 2022) for samples from a stale behaviour policy.

    loss = -sg[exp(prox - old)] * min(r A, clip(r, 1-low, 1+high) A), r = exp(logp - prox):
    the trust region is centred on the proximal policy and the behaviour policy (old_logp) is
    corrected by importance weighting. With prox == old it is exactly ppo.
    """
    if prox_logp is None:
        raise ValueError("decoupled_ppo needs prox_logp: log-probs of the sampled tokens under "
                         "the proximal policy (the weights before this update)")
    logp, old_logp, prox_logp, adv = _zero_padding(mask, logp, old_logp, prox_logp, advantages)
    behaviour_weight = _ratio(prox_logp, old_logp).detach()
    loss, clipped = _clipped_surrogate(_ratio(logp, prox_logp), adv, cfg)
    return _finish(behaviour_weight * loss, clipped, mask)


@POLICY_LOSSES.register("reinforce")
def reinforce(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, cfg: PolicyLossConfig, prox_logp: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain policy gradient -A log pi: no ratio, nothing clipped (on-policy only)."""
    logp, adv = _zero_padding(mask, logp, advantages)
    return _finish(-adv * logp, torch.zeros_like(mask, dtype=torch.bool), mask)
