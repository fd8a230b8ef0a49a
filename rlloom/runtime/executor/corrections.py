"""Corrections the training group makes to samples before an update: the trainer's own
log-probs in place of another sampler's (rollout correction), and decoupled PPO for stale
samples. Each is a forward over the batch in the training layout."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rlloom.algos.kl import LOG_RATIO_CLAMP
from rlloom.algos.rollout_correction import mismatch_stats, tis_weights
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.rollout.generate import Rollout
from rlloom.rollout.routes import Agreement
from rlloom.runtime.ranks import RankGroup, Share
from rlloom.runtime.stages.experience import Experience
from rlloom.runtime.stages.online import logprobs_of, rows_scored


@dataclass(frozen=True)
class Rows:
    """How the training group runs a forward over a batch's rows: micro-batches of at most
    `budget` padded tokens, each data-parallel replica (`share`) its share (`rows_scored`)."""
    budget: int | None = None
    ranks: RankGroup | None = None
    share: Share = Share()


def _trainer_logprobs(r: Rollout, policy: torch.nn.Module | PipelinedModel, temperature: float,
                      rows: Rows) -> torch.Tensor:
    """The sampled tokens' log-probs under the trainer's current weights [n, T], computed as
    `perf.model.cost.forward` prices them: length-bucketed, shared over data parallelism (a
    forward over whole mini-batches padded to their longest row cost 2-3x the training of a
    step with one long response)."""
    def score(mb: Rollout) -> torch.Tensor:
        with Agreement().of(policy, mb.routes):  # routing replay: the generator's experts
            return logprobs_of(policy, mb, temperature)
    return rows_scored(score, r, rows.budget, rows.ranks, rows.share)


@torch.no_grad()
def sampler_corrected(exp: Experience, policy: torch.nn.Module | PipelinedModel,
                      temperature: float, rows: Rows, mode: str, cap: float
                      ) -> tuple[Experience, dict[str, float]]:
    """Rollouts of another engine or precision (algos/rollout_correction.py): the trainer's
    log-probs replace the sampler's as PPO's old log-probs, the advantages are weighted by the
    truncated importance ratio of `mode`, and the mismatch is measured."""
    r = exp.samples.rollout
    mask = r.action_mask.float()
    keep = mask > 0
    trainer = torch.where(keep, _trainer_logprobs(r, policy, temperature, rows), 0.0)
    sampler = torch.where(keep, r.logprobs, 0.0)
    weights = tis_weights(trainer, sampler, mask, mode, cap)
    samples = replace(exp.samples, rollout=replace(r, logprobs=trainer))
    return (replace(exp, samples=samples, advantages=exp.advantages * weights),
            mismatch_stats(trainer, sampler, mask, weights, cap))


@torch.no_grad()
def decoupled(exp: Experience, policy: torch.nn.Module | PipelinedModel, temperature: float,
              rows: Rows = Rows()) -> tuple[Experience, float]:
    """Decoupled PPO for stale samples, expressed for the plain `ppo` loss that `optimise`
    calls: the proximal log-probs (the weights before this update) replace the behaviour
    log-probs as PPO's `old_logp`, and the advantages are scaled by the detached behaviour
    weight w = exp(prox - behaviour). Because w > 0 is constant per token, min(r wA, clip(r) wA)
    = w min(rA, clip(r) A) with the same clipped branch (and dual clip), so the loss equals
    `decoupled_ppo(logp, behaviour, A, prox)` (tests/runtime/test_ray_stages.py).
    Returns the corrected experience and the k1 KL(behaviour || proximal) per token."""
    r = exp.samples.rollout
    prox = _trainer_logprobs(r, policy, temperature, rows)
    mask = r.action_mask.float()
    keep = mask > 0
    prox, old = torch.where(keep, prox, 0.0), torch.where(keep, r.logprobs, 0.0)
    weight = (prox - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    kl = (((old - prox) * mask).sum() / mask.sum().clamp(min=1)).item()
    samples = replace(exp.samples, rollout=replace(r, logprobs=prox))
    return replace(exp, samples=samples, advantages=exp.advantages * weight), kl
