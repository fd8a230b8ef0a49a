"""Advantage estimators: per-token rewards (+ critic values) -> per-token advantages and returns.

Every estimator takes one `AdvantageInputs` and returns (advantages [n, T], returns [n, T]),
both zero at masked positions. They run without autograd: advantages and returns are
constants for the losses that consume them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlloom.algos.masks import last_token, masked_whiten, valid
from rlloom.algos.registry import Registry

# added to the group std so a group with identical scores gets advantage 0, not 0/0.
GRPO_EPS = 1e-6
# added to the batch variance (inside the square root) when whitening token advantages.
WHITEN_EPS = 1e-8


@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor  # [n, T] verifier score on the last real token, KL shaping on all
    mask: torch.Tensor  # [n, T] float, 1 on response tokens
    group_ids: torch.Tensor  # [n] long: samples of the same prompt share an id
    values: torch.Tensor | None = None  # [n, T] critic V(s_t) of the state before token t (gae)
    baseline_rewards: torch.Tensor | None = None  # [n] greedy-rollout score of the prompt (remax)
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # GAE lambda

    def __post_init__(self) -> None:
        if self.token_rewards.dim() != 2 or self.token_rewards.shape != self.mask.shape:
            raise ValueError(f"token_rewards {tuple(self.token_rewards.shape)} and mask "
                             f"{tuple(self.mask.shape)} must both be [n, T]")
        n = self.mask.shape[0]
        if self.group_ids.shape != (n,):
            raise ValueError(f"group_ids must be [n]={n}, got {tuple(self.group_ids.shape)}")
        if self.values is not None and self.values.shape != self.mask.shape:
            raise ValueError(f"values must be [n, T] like mask, got {tuple(self.values.shape)}")
        if self.baseline_rewards is not None and self.baseline_rewards.shape != (n,):
            raise ValueError(f"baseline_rewards must be [n]={n}, "
                             f"got {tuple(self.baseline_rewards.shape)}")

    def scores(self) -> torch.Tensor:
        """Sequence score s_i = sum_t token_rewards * mask  # [n]."""
        return torch.where(valid(self.mask), self.token_rewards, 0).sum(dim=1)


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n] -> [n, T], zero on padding."""
    return torch.where(valid(mask), per_seq[:, None], 0)


def _group_sum(inverse: torch.Tensor, groups: int, values: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of `values` over the sample's group [n]."""
    sums = torch.zeros(groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, inverse, values)[inverse]


def _groups(group_ids: torch.Tensor, scores: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group index, group size, group mean) of the scores, each [n].

    The mean is taken as the group's minimum plus the mean offset from it, so a group whose
    scores are all equal gets exactly that score as its mean and `s - mean` is exactly 0, in
    any dtype and for any value (0.7 or 1/3 in float32 at K=8 would otherwise leave an
    offset of a few ulps, which the std division blows up)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    low = torch.full((len(counts),), torch.inf, dtype=scores.dtype, device=scores.device)
    low = low.scatter_reduce(0, inverse, scores, "amin")[inverse]
    size = counts[inverse].to(scores.dtype)
    return inverse, size, low + _group_sum(inverse, len(counts), scores - low) / size


def _require_pairs(size: torch.Tensor, estimator: str) -> None:
    if (size < 2).any():
        raise ValueError(f"{estimator} needs at least 2 samples per prompt (group_ids has a "
                         "group of size 1); sample n >= 2 responses per prompt")


@ADVANTAGES.register("grpo")
@torch.no_grad()
def grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = (s_i - mean_g s) / (std_g s + GRPO_EPS), broadcast over the response tokens.

    std_g is the unbiased sample std of the group (divides by K-1), so K >= 2 is required.
    Returns equal the advantages (there is no critic).
    """
    # float64: the squares of rewards past ~1e19 overflow float32, and an infinite std made
    # every advantage 0 without a word
    s = x.scores().double()
    inverse, size, mean = _groups(x.group_ids, s)
    _require_pairs(size, "grpo")
    std = (_group_sum(inverse, int(inverse.max()) + 1, (s - mean) ** 2) / (size - 1)).sqrt()
    adv = _broadcast(((s - mean) / (std + GRPO_EPS)).to(x.token_rewards.dtype), x.mask)
    return adv, adv.clone()


@ADVANTAGES.register("dr_grpo")
@torch.no_grad()
def dr_grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = s_i - mean_g s (Dr. GRPO: no std division), broadcast; returns = advantages."""
    s = x.scores()
    _, _, mean = _groups(x.group_ids, s)
    adv = _broadcast(s - mean, x.mask)
    return adv, adv.clone()


@ADVANTAGES.register("rloo")
@torch.no_grad()
def rloo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = s_i - (sum_g s - s_i) / (K - 1): leave-one-out baseline, broadcast.

    Computed as K/(K-1) (s_i - mean_g s), which is exactly 0 for a group of equal scores.
    Returns = advantages.
    """
    s = x.scores()
    _, size, mean = _groups(x.group_ids, s)
    _require_pairs(size, "rloo")
    adv = _broadcast(size / (size - 1) * (s - mean), x.mask)
    return adv, adv.clone()


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float
                        ) -> torch.Tensor:
    """G_t = sum_{t' >= t, valid} gamma^(t'-t) r_t', scanning valid tokens only."""
    keep = valid(mask)
    carry = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = []
    for t in reversed(range(rewards.shape[1])):
        # padding passes the carry through, so holes in the mask neither add nor discount.
        carry = torch.where(keep[:, t], rewards[:, t] + gamma * carry, carry)
        out.append(carry)
    return torch.where(keep, torch.stack(out[::-1], dim=1), 0)


@ADVANTAGES.register("reinforce_pp")
@torch.no_grad()
def reinforce_pp(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: G_t = sum_{t'>=t} gamma^(t'-t) r_t', A = (G - mean) / sqrt(var + 1e-8).

    Mean and std run over all valid tokens of the batch; the std is the population std
    (divides by the token count). Returns are the raw G.
    """
    returns = _discounted_returns(x.token_rewards, x.mask, x.gamma)
    return masked_whiten(returns, x.mask, WHITEN_EPS), returns


@ADVANTAGES.register("reinforce_pp_baseline")
@torch.no_grad()
def reinforce_pp_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: r_last,i -= mean_g s, then as reinforce_pp.

    Only the last valid token's reward moves, so the sequence score becomes s_i - mean_g s
    while per-token shaping (e.g. KL) is kept.
    """
    _, _, mean = _groups(x.group_ids, x.scores())
    rewards = x.token_rewards - torch.where(last_token(x.mask), mean[:, None], 0)
    returns = _discounted_returns(rewards, x.mask, x.gamma)
    return masked_whiten(returns, x.mask, WHITEN_EPS), returns


@ADVANTAGES.register("remax", needs={"greedy_baseline"})
@torch.no_grad()
def remax(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: A_i = s_i - b_i with b_i the greedy rollout's score, broadcast; returns = A."""
    if x.baseline_rewards is None:
        raise ValueError("remax needs baseline_rewards: the score of a greedy rollout of each "
                         "sample's prompt")
    adv = _broadcast(x.scores() - x.baseline_rewards, x.mask)
    return adv, adv.clone()


@ADVANTAGES.register("gae", needs={"critic"})
@torch.no_grad()
def gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over valid tokens.

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, where "t+1" is
    the next valid token and V, A after the last valid token are 0. Returns = A + V (the
    critic's target, before whitening); the advantages are then whitened over the batch's
    valid tokens, population std, eps 1e-8.
    """
    if x.values is None:
        raise ValueError("gae needs critic values [n, T]; use a critic-free estimator "
                         "(grpo, rloo, reinforce_pp, ...) when there is no critic")
    keep = valid(x.mask)
    n, length = x.mask.shape
    next_value = torch.zeros(n, dtype=x.values.dtype, device=x.values.device)
    next_adv = torch.zeros_like(next_value)
    out = []
    for t in reversed(range(length)):
        delta = x.token_rewards[:, t] + x.gamma * next_value - x.values[:, t]
        # padding passes both carries through: the next state is the next valid token.
        next_adv = torch.where(keep[:, t], delta + x.gamma * x.lam * next_adv, next_adv)
        next_value = torch.where(keep[:, t], x.values[:, t], next_value)
        out.append(next_adv)
    raw = torch.where(keep, torch.stack(out[::-1], dim=1), 0)
    returns = torch.where(keep, raw + x.values, 0)
    return masked_whiten(raw, x.mask, WHITEN_EPS), returns
