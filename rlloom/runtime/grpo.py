"""One GRPO iteration in one process: Generation -> Assessment -> Training."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from rlloom.config import AlgoSection
from rlloom.data.synthetic import Problem
from rlloom.models.transformer import CausalLM
from rlloom.rewards.synthetic import score
from rlloom.rollout.generate import Rollout, generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.batch import response_logprobs


@dataclass
class Experience:
    rollout: Rollout
    group_ids: torch.Tensor     # [n] index of the prompt each sample answers
    rewards: torch.Tensor       # [n]
    correct: torch.Tensor       # [n] bool
    ref_logp: torch.Tensor      # [n, T]
    advantages: torch.Tensor    # [n, T]


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in texts]


def decode_responses(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(rollout.response_ids, rollout.response_mask)]


def sample_group(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
                 k: int, params: SamplingParams, generator: torch.Generator
                 ) -> tuple[Rollout, torch.Tensor]:
    encoded = encode(tokenizer, [p.prompt for p in problems])
    prompts = [ids for ids in encoded for _ in range(k)]
    rollout = generate(policy, prompts, params, tokenizer.eos_token_id, tokenizer.pad_token_id,
                       generator)
    return rollout, torch.arange(len(problems)).repeat_interleave(k)


def assess(reference: CausalLM, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
           rollout: Rollout, group_ids: torch.Tensor, task: str, algo: AlgoSection,
           temperature: float) -> Experience:
    """Rewards from the verifier, reference log-probs and group-normalised advantages."""
    texts = decode_responses(tokenizer, rollout)
    scores = [score(problems[g], text, task, algo.format_reward)
              for g, text in zip(group_ids.tolist(), texts)]
    rewards = torch.tensor([s.reward for s in scores])
    with torch.no_grad():
        ref_logp, _ = response_logprobs(reference, rollout.prompt_ids, rollout.prompt_mask,
                                        rollout.response_ids, rollout.response_mask, temperature)
    advantages = ADVANTAGES.get(algo.advantage)(rewards, group_ids,
                                                rollout.response_mask.float())
    return Experience(rollout, group_ids, rewards, torch.tensor([s.correct for s in scores]),
                      ref_logp, advantages)


def optimise(policy: CausalLM, optimizer: torch.optim.Optimizer, exp: Experience,
             algo: AlgoSection, temperature: float, grad_clip: float,
             generator: torch.Generator) -> dict[str, float]:
    """`algo.epochs` passes of PPO-clip + KL over shuffled mini-batches."""
    r = exp.rollout
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)
    kl_fn = KL_ESTIMATORS.get(algo.kl_estimator)
    aggregate = AGGREGATIONS.get(algo.loss_agg)
    n = r.response_ids.shape[0]
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    updates = 0
    for _ in range(algo.epochs):
        for idx in torch.randperm(n, generator=generator).chunk(algo.minibatches):
            mask = r.response_mask[idx].float()
            tokens = mask.sum()
            logp, entropy = response_logprobs(policy, r.prompt_ids[idx], r.prompt_mask[idx],
                                              r.response_ids[idx], r.response_mask[idx],
                                              temperature, with_entropy=True)
            pg, clipped = policy_loss(logp, r.logprobs[idx], exp.advantages[idx],
                                      algo.clip_low, algo.clip_high)
            kl = kl_fn(logp, exp.ref_logp[idx])
            loss = aggregate(pg + algo.kl_coef * kl, mask, tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), grad_clip)
            optimizer.step()
            updates += 1
            totals["loss"] += loss.item()
            totals["kl"] += ((kl.detach() * mask).sum() / tokens).item()
            totals["clip_frac"] += ((clipped.float() * mask).sum() / tokens).item()
            totals["entropy"] += ((entropy * mask).sum() / tokens).item()
            totals["grad_norm"] += grad_norm.item()
    return {k: v / updates for k, v in totals.items()}
