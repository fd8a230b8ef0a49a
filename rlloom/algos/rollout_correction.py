"""Sampler/trainer mismatch: when the rollouts come from another engine (vLLM) or another
precision, the sampler's log-probs are not the trainer's for the same weights, and PPO's ratio
and advantages would be taken against a policy that was never trained. The trainer then
recomputes the behaviour log-probs with its own forward (they become PPO's `old_logp`), logs
the mismatch every step, and can weight each token (or sequence) by the truncated importance
ratio trainer / sampler (TIS, as verl's `rollout_is` and slime's TIS), so the gradient stays
an estimate for the samples' true distribution without the variance of an uncapped ratio.

`recomputes_behaviour` decides it for the runtime (runtime/executor/hosts.py) and the cost
model (the extra forward, perf/model/compose.py) alike."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cost model imports `recomputes_behaviour` and must not load torch
    import torch

def recomputes_behaviour(engine: str, rollout_is: str) -> bool:
    """Whether the trainer recomputes the behaviour log-probs: always for another engine
    (`rollout.engine=vllm`), and whenever a correction is asked for (`algo.rollout_is`)."""
    return engine == "vllm" or rollout_is != "none"


def tis_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                mode: str, cap: float) -> torch.Tensor:
    """Detached weights [n, T], 0 on padding: `token_tis` min(pi_trainer / pi_sampler, cap)
    per token, `seq_tis` min(prod_t pi_trainer / pi_sampler, cap) per sequence, `none` 1."""
    import torch

    from rlloom.algos.kl import LOG_RATIO_CLAMP
    keep = mask > 0
    if mode == "none":
        return keep.to(trainer_logp.dtype)
    log_ratio = torch.where(keep, trainer_logp - sampler_logp, 0.0)
    if mode == "seq_tis":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(log_ratio)
    weight = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().clamp(max=cap)
    return torch.where(keep, weight, 0.0).detach()


def mismatch_stats(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                   weights: torch.Tensor, cap: float) -> dict[str, float]:
    """`mismatch_k1`: mean over tokens of log pi_sampler - log pi_trainer (k1 estimate of
    KL(sampler || trainer), the tokens being the sampler's); `mismatch_max_ratio`: the
    largest pi_trainer / pi_sampler over tokens; `tis_mean` and `tis_capped` (share of tokens
    at the cap) of the weights applied."""
    import torch

    from rlloom.algos.kl import LOG_RATIO_CLAMP
    keep = mask > 0
    tokens = keep.sum().clamp(min=1)
    diff = torch.where(keep, sampler_logp - trainer_logp, 0.0)
    ratio = torch.where(keep, (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(), 0.0)
    return {"mismatch_k1": (diff.sum() / tokens).item(),
            "mismatch_max_ratio": ratio.max().item() if keep.any() else 1.0,
            "tis_mean": (torch.where(keep, weights, 0.0).sum() / tokens).item(),
            "tis_capped": ((keep & (weights >= cap)).sum() / tokens).item()}
