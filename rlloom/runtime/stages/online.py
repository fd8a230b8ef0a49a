"""Assessment and Training of an online RL step, for every online preset (the estimator, loss
and KL placement come from the registries by name); Generation is generation.py."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from rlloom.algos.advantages import ADVANTAGES, AdvantageInputs
from rlloom.algos.aggregation import AGGREGATIONS, LossNorm
from rlloom.algos.dapo import overlong_penalty
from rlloom.algos.kl import kl_shaped_rewards
from rlloom.algos.masks import valid
from rlloom.algos.value import value_loss
from rlloom.config import AlgoSection, RunConfig
from rlloom.config_sections import RolloutSection
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.transformer import CausalLM
from rlloom.parallel.data_parallel import before_backward
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.rollout.generate import Rollout
from rlloom.runtime.ranks import RankGroup, Share
from rlloom.runtime.stages import nonfinite
from rlloom.rollout.routes import Agreement
from rlloom.runtime.stages.batch import response_logprobs, response_values
from rlloom.runtime.stages.experience import Experience
from rlloom.runtime.stages.generation import Samples
from rlloom.runtime.stages.objective import micro_rows, token_loss
from rlloom.runtime.stages.packing import Agree, micro_batches, trim
from rlloom.runtime.stages.pipelined import (
    pipelined_backward,
    pipelined_critic_backward,
    pipelined_logprobs,
    pipelined_values,
)
from rlloom.runtime.stages.shared_prompt import SharedPrompts, prompt_chunks


@torch.no_grad()
def scores(s: Samples, reference: CausalLM | PipelinedModel | None,
           critic: ValueModel | ActorCritic | PipelinedModel | None,
           cfg: RunConfig, ranks: RankGroup | None = None, ref_share: Share = Share(),
           critic_share: Share = Share()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The forward passes of assessment: reference log-probs and critic values [n, T].

    In one process they run in length-bucketed micro-batches after one prompt pass per
    distinct prompt. In a group of ranks that all hold the whole batch, each data-parallel
    replica of a model's layout (`ref_share`, `critic_share`) scores its share of the rows in
    as many plain micro-batches as every other rank (their collectives pair up), and the
    shares are all-gathered."""
    r, budget = s.rollout, cfg.train.micro_batch_tokens
    if ranks is not None and ranks.world > 1:
        return ((rows_scored(lambda mb: logprobs_of(reference, mb, cfg.rollout.temperature),
                             r, budget, ranks, ref_share) if reference is not None else None),
                (rows_scored(lambda mb: values_of(critic, mb), r, budget, ranks, critic_share)
                 if critic is not None else None))
    ref_logp = None
    if reference is not None:
        ref_logp = torch.zeros(r.response_ids.shape, device=r.response_ids.device)
        for chunk in prompt_chunks(r, budget):
            part = r.select(chunk)
            prompts = SharedPrompts(reference, part, train=False)
            ref_logp[chunk] = bucketed(lambda mb, rows, prompts=prompts: response_logprobs(
                reference, mb, cfg.rollout.temperature, prompts=prompts, rows=rows)[0], part,
                budget, prompts_done=True)
    old_values = (rows_scored(lambda mb: values_of(critic, mb), r, budget)
                  if critic is not None else None)
    return ref_logp, old_values


def logprobs_of(model: CausalLM | PipelinedModel, r: Rollout, temperature: float
                ) -> torch.Tensor:
    """The sampled tokens' log-probs [n, T] under `model` (`batch.response_logprobs`, or a
    pipelined model's)."""
    if isinstance(model, PipelinedModel):
        return pipelined_logprobs(model, r, temperature)
    return response_logprobs(model, r, temperature)[0]


def values_of(critic: ValueModel | ActorCritic | PipelinedModel, r: Rollout) -> torch.Tensor:
    """Critic values [n, T] (`batch.response_values`, or a pipelined critic's)."""
    if isinstance(critic, PipelinedModel):
        return pipelined_values(critic, r)
    return response_values(critic, r)


def assess(s: Samples, reference: CausalLM | None, critic: ValueModel | ActorCritic | None,
           kl_coef: float, baseline: torch.Tensor | None, cfg: RunConfig,
           ranks: RankGroup | None = None, ref_share: Share = Share(),
           critic_share: Share = Share()) -> Experience:
    """Reference log-probs, critic values (`scores`), shaped rewards and advantages over the
    whole batch."""
    ref_logp, old_values = scores(s, reference, critic, cfg, ranks, ref_share, critic_share)
    return assess_from(s, ref_logp, old_values, kl_coef, baseline, cfg)


@torch.no_grad()
def assess_from(s: Samples, ref_logp: torch.Tensor | None, old_values: torch.Tensor | None,
                kl_coef: float, baseline: torch.Tensor | None, cfg: RunConfig) -> Experience:
    """Shaped rewards and advantages from the forward passes' outputs; a fused schedule runs
    those passes per chunk as chunks arrive and calls this once over the whole batch (GAE and
    REINFORCE++ whiten over it)."""
    a, r = cfg.algo, s.rollout
    mask = r.action_mask.float()  # tool results inserted into a response are not actions
    scores = s.scores
    if a.overlong == "penalty":
        scores = scores + overlong_penalty(r.response_lengths, cfg.rollout.max_new_tokens,
                                           min(a.overlong_cache, cfg.rollout.max_new_tokens))
    loss_mask = mask * r.finished[:, None] if a.overlong == "filter" else mask
    shaping = kl_coef if a.kl_in_reward and ref_logp is not None else 0.0
    token_rewards = kl_shaped_rewards(scores, mask, r.logprobs,
                                      ref_logp if ref_logp is not None else r.logprobs,
                                      shaping, a.kl_estimator)
    # Filtered (overlong) samples still count in group statistics; they only stop training.
    advantages, returns = ADVANTAGES.get(a.advantage)(AdvantageInputs(
        token_rewards, mask, s.group_ids, old_values, baseline, a.gamma, a.lam))
    return Experience(s, loss_mask, ref_logp, old_values, advantages * loss_mask, returns)


def rows_scored(fn: Callable[[Rollout], torch.Tensor], r: Rollout, budget: int | None,
                ranks: RankGroup | None = None, share: Share = Share()) -> torch.Tensor:
    """`fn(micro-batch)` [rows, T] of every row of `r`, in length-bucketed micro-batches
    (`bucketed`). In a group of ranks that all hold the whole batch, each data-parallel
    replica of the scoring model's layout (`share`) scores its share of the rows in as many
    micro-batches as every other rank (their collectives pair up), and the shares are
    all-gathered: the work `perf.model.cost.forward` prices."""
    if ranks is None or ranks.world == 1:
        return bucketed(lambda mb, _: fn(mb), r, budget)
    rows = share.rows(torch.arange(len(r.finished), device=r.finished.device))
    part = bucketed(lambda mb, _: fn(mb), r.select(rows), budget, agree=ranks.most)
    out = torch.zeros(r.response_ids.shape, device=r.response_ids.device)
    for got in ranks.gather((rows.cpu(), part.cpu()) if share.leader else None):
        if got is not None:
            out[got[0].to(out.device)] = got[1].to(out.device)
    return out


def bucketed(score: Callable[[Rollout, torch.Tensor], torch.Tensor], r: Rollout,
             budget: int | None, prompts_done: bool = False, agree: Agree | None = None
             ) -> torch.Tensor:
    """`score(micro-batch, its rows)` [rows, T] of every row, computed on length-bucketed
    micro-batches (no forward over the batch's padding) and put back in the rollout's row
    order and width. `prompts_done`: the score runs responses only, so only they are cut."""
    out = torch.zeros(r.response_ids.shape, device=r.response_ids.device)
    for rows in micro_batches(r.prompt_mask.sum(1), r.response_mask.sum(1), budget,
                              prompts_done, agree):
        part = score(trim(r.select(rows)), rows)
        out[rows, :part.shape[1]] = part.float()
    return out


def optimise(policy: CausalLM | PipelinedModel, optimizer: torch.optim.Optimizer,
             exp: Experience,
             critic: ValueModel | None, critic_optimizer: torch.optim.Optimizer | None,
             kl_coef: float, cfg: RunConfig, generator: torch.Generator,
             share: Share = Share(), critic_share: Share = Share(),
             agree: Agree | None = None) -> dict[str, float]:
    """`algo.epochs` passes over shuffled mini-batches: policy loss (+ KL in the loss, - entropy
    bonus, + value loss for a shared actor-critic); a separate critic steps alongside. Each
    mini-batch runs as length-bucketed micro-batches of at most `train.micro_batch_tokens`
    padded tokens after one prompt pass per distinct prompt (given `agree`, in a group of
    ranks: as many plain micro-batches as every other rank), accumulating the mini-batch's
    gradient. In a group every rank holds the whole batch and draws the same shuffle; each
    trains on its data-parallel `share` of every mini-batch (`critic_share` for the critic's
    layout) with the whole mini-batch's normalisers over dp (runtime/ranks.py). A
    pipelined actor trains each micro-batch with a 1F1B schedule (stages/pipelined.py)."""
    r = exp.samples.rollout
    budget = cfg.train.micro_batch_tokens
    # a replayed row routes its prompt as it was generated, so prompts are not shared
    share_prompts = (agree is None and not isinstance(policy, ActorCritic)
                     and cfg.algo.routing_replay == "none")
    totals: dict[str, float] = {}
    updates = skipped = 0
    stop = cfg.train.on_nonfinite == "stop"
    for quantity, values in (("reward", exp.samples.scores), ("advantage", exp.advantages)):
        if not nonfinite.finite(values):  # every rank holds the whole batch: all agree
            return ({"nonfinite": nonfinite.code(quantity)} if stop else
                    {"nonfinite_skips": float(cfg.algo.epochs * cfg.algo.minibatches)})
    for _ in range(cfg.algo.epochs):
        # the CPU generator keeps shuffles reproducible on any device
        order = torch.randperm(len(r.finished), generator=generator).to(r.finished.device)
        for idx in order.chunk(cfg.algo.minibatches):
            mask = exp.loss_mask[idx]
            tokens, seqs = float(valid(mask).sum()), float(mask.shape[0])
            if tokens == 0:
                continue  # every sample was filtered out (overlong), on every rank alike
            optimizer.zero_grad(set_to_none=True)
            norm = _norm(tokens, seqs, share, cfg.rollout)
            if isinstance(policy, PipelinedModel):
                stats = pipelined_backward(policy, exp, share.rows(idx), norm, kl_coef, cfg,
                                           budget, agree)
            else:
                stats = policy_backward(policy, exp, share.rows(idx), norm, kl_coef, cfg,
                                        budget, share_prompts, agree)
            share.reduce(_module(policy))
            # the norm is global over the group's ranks, so every rank decides alike
            grad_norm = share.clip_grad_norm(policy, cfg.train.grad_clip)
            if not nonfinite.finite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                if stop:
                    return {"nonfinite": nonfinite.code("policy loss or gradient norm")}
                skipped += 1
                continue
            stats["grad_norm"] = grad_norm.item()
            optimizer.step()
            if critic is not None:
                critic_optimizer.zero_grad(set_to_none=True)
                rows, norm = critic_share.rows(idx), _norm(tokens, seqs, critic_share, cfg.rollout)
                if isinstance(critic, PipelinedModel):
                    stats["value_loss"] = pipelined_critic_backward(
                        critic, exp, rows, norm, cfg.algo, budget, agree)
                else:
                    stats["value_loss"] = critic_backward(critic, exp, rows, norm, cfg.algo, budget,
                                                          agree)
                critic_share.reduce(_module(critic))
                if nonfinite.finite(critic_share.clip_grad_norm(critic, cfg.train.grad_clip)):
                    critic_optimizer.step()
                elif stop:
                    return {"nonfinite": nonfinite.code("critic loss or gradient norm")}
                else:
                    critic_optimizer.zero_grad(set_to_none=True)
                    skipped += 1
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    out = {k: v / max(updates, 1) for k, v in totals.items()}
    return {**out, "nonfinite_skips": float(skipped)} if skipped else out


def _norm(tokens: float, seqs: float, share: Share, rollout: RolloutSection) -> LossNorm:
    """The whole mini-batch's normalisers over the replicas whose gradients DP averages."""
    return LossNorm(tokens / share.parts, seqs / share.parts, const=rollout.max_new_tokens)


def policy_backward(policy: CausalLM, exp: Experience, idx: torch.Tensor, norm: LossNorm,
                    kl_coef: float, cfg: RunConfig, micro_batch_tokens: int | None,
                    share_prompts: bool = False, agree: Agree | None = None
                    ) -> dict[str, float]:
    """Accumulate into `.grad` the gradient of mini-batch `idx`'s loss, one micro-batch at a
    time, and return its statistics (token means over the whole mini-batch)."""
    a = cfg.algo
    objective = token_loss(exp, norm, kl_coef, cfg)
    actor_critic = isinstance(policy, ActorCritic)
    sums = objective.sums()
    if actor_critic:
        sums["value_loss"] = 0.0
    r = exp.samples.rollout
    # a shared prompt pass per chunk of prompts that fits the budget, its graph kept until the
    # chunk's responses are done
    chunks = (prompt_chunks(r.select(idx), micro_batch_tokens) if share_prompts
              else [torch.arange(len(idx), device=idx.device)])
    replay = Agreement() if a.routing_replay == "replay" else None
    for c, chunk in enumerate(chunks):
        sub = idx[chunk]
        prompts = SharedPrompts(policy, r.select(sub), train=True) if share_prompts else None
        parts = list(micro_rows(exp, sub, micro_batch_tokens, share_prompts, agree))
        for j, (part, rows, mb, t) in enumerate(parts):
            # forward and backward (whose recompute of checkpointed layers routes again)
            with replay.of(policy, mb.routes) if replay else nullcontext():
                mask = exp.loss_mask[rows, :t]
                logp, entropy, values = response_logprobs(
                    policy, mb, cfg.rollout.temperature, with_entropy=True, prompts=prompts,
                    rows=part)
                loss = objective(logp, entropy, mb.logprobs, exp.advantages[rows, :t], mask,
                                 None if exp.ref_logp is None else exp.ref_logp[rows, :t],
                                 sums)
                if actor_critic:
                    vloss = AGGREGATIONS.get(a.loss_agg)(
                        value_loss(values, exp.old_values[rows, :t], exp.returns[rows, :t],
                                   mask, a.value_clip), mask, norm)
                    loss = loss + a.vf_coef * vloss
                    sums["value_loss"] += vloss.item()
                before_backward(policy, last=prompts is None and c == len(chunks) - 1
                                and j == len(parts) - 1)
                loss.backward()
            sums["loss"] += loss.item()
        if prompts is not None:
            before_backward(policy, last=c == len(chunks) - 1)
            prompts.backward()
    means = objective.means(sums)
    return {**means, "routing_agreement": replay.value()} if replay else means


def critic_backward(critic: ValueModel, exp: Experience, idx: torch.Tensor, norm: LossNorm,
                    algo: AlgoSection, micro_batch_tokens: int | None,
                    agree: Agree | None = None) -> float:
    """Accumulate a separate critic's value-loss gradient of mini-batch `idx`; the loss."""
    aggregate = AGGREGATIONS.get(algo.loss_agg)
    total = 0.0
    parts = list(micro_rows(exp, idx, micro_batch_tokens, agree=agree))
    for j, (_, rows, mb, t) in enumerate(parts):
        mask = exp.loss_mask[rows, :t]
        vloss = aggregate(value_loss(response_values(critic, mb), exp.old_values[rows, :t],
                                     exp.returns[rows, :t], mask, algo.value_clip),
                          mask, norm)
        before_backward(critic, last=j == len(parts) - 1)
        vloss.backward()
        total += vloss.item()
    return total


def _mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x.detach() * mask).sum() / mask.sum().clamp(min=1)).item()


def behaviour_kl(exp: Experience) -> float:
    """Mean per-token k1 KL of the sampling policy to the reference (what adaptive KL tracks)."""
    if exp.ref_logp is None:
        return 0.0
    return _mean(exp.samples.rollout.logprobs - exp.ref_logp, exp.samples.rollout.action_mask)


def _module(model: nn.Module | PipelinedModel) -> nn.Module:
    """What holds the parameters: the model, or this rank's stage of a pipeline."""
    return model.module if isinstance(model, PipelinedModel) else model
