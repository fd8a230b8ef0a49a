"""The policy's training objective per micro-batch, shared by every way of running the
backward pass (one process, a group of ranks, a pipeline of stages)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlloom.algos.aggregation import AGGREGATIONS, LossNorm
from rlloom.algos.kl import KL_ESTIMATORS
from rlloom.algos.policy_losses import POLICY_LOSSES, PolicyLossConfig
from rlloom.config import RunConfig
from rlloom.rollout.generate import Rollout
from rlloom.runtime.stages.packing import Agree, micro_batches, trim

if TYPE_CHECKING:
    from rlloom.runtime.stages.experience import Experience


def micro_rows(exp: Experience, idx: torch.Tensor, budget: int | None,
               prompts_done: bool = False, agree: Agree | None = None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, Rollout, int]]:
    """(positions in `idx`, rows, trimmed rollout of those rows, its response width) per
    micro-batch of `idx`."""
    r = exp.samples.rollout.select(idx)
    for part in micro_batches(r.prompt_mask.sum(1), r.response_mask.sum(1), budget,
                              prompts_done, agree):
        mb = trim(r.select(part))
        yield part, idx[part], mb, mb.response_ids.shape[1]


@dataclass(frozen=True)
class TokenLoss:
    """The policy's per-token training objective: the registered policy loss (+ KL to the
    reference in the loss, - the entropy bonus), aggregated with the whole mini-batch's
    normalisers, so that summing it over micro-batches gives the mini-batch's loss."""
    cfg: RunConfig
    norm: LossNorm
    kl_coef: float
    kl_in_loss: bool

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor, old_logp: torch.Tensor,
                 advantages: torch.Tensor, mask: torch.Tensor, ref_logp: torch.Tensor | None,
                 sums: dict[str, float]) -> torch.Tensor:
        """The loss of one micro-batch [rows, T]; adds its statistics' sums into `sums`."""
        a = self.cfg.algo
        # one process and torchrun train on samples of the weights this step starts from,
        # so the proximal policy is the behaviour policy: decoupled_ppo is ppo, as on Ray
        # at staleness 0 (a stale Ray step corrects its samples first: corrections.decoupled)
        per_token, clipped = POLICY_LOSSES.get(a.policy_loss)(
            logp, old_logp, advantages, mask, PolicyLossConfig.from_algo(a), prox_logp=old_logp)
        sums["clip_frac"] += masked_sum(clipped.float(), mask)
        sums["entropy"] += masked_sum(entropy, mask)
        if self.kl_in_loss:
            kl = KL_ESTIMATORS.get(a.kl_estimator)(logp, ref_logp)
            per_token = per_token + self.kl_coef * kl
            sums["kl"] += masked_sum(kl, mask)
        if a.entropy_coef:
            per_token = per_token - a.entropy_coef * entropy
        return AGGREGATIONS.get(a.loss_agg)(per_token, mask, self.norm)

    def sums(self) -> dict[str, float]:
        """Zeroed statistics of a mini-batch."""
        return {"loss": 0.0, "clip_frac": 0.0, "entropy": 0.0,
                **({"kl": 0.0} if self.kl_in_loss else {})}

    def means(self, sums: dict[str, float]) -> dict[str, float]:
        """Token means of the whole mini-batch over dp."""
        return {k: v / self.norm.tokens if k in ("clip_frac", "entropy", "kl") else v
                for k, v in sums.items()}


def token_loss(exp: Experience, norm: LossNorm, kl_coef: float, cfg: RunConfig) -> TokenLoss:
    return TokenLoss(cfg, norm, kl_coef,
                     not cfg.algo.kl_in_reward and exp.ref_logp is not None and kl_coef > 0)




def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> float:
    return (x.detach() * mask).sum().item()
