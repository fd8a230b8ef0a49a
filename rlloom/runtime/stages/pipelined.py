"""The passes of a model that trains on a pipeline of stages (`rlloom.parallel.pipeline`):
the actor's policy loss and log-probs (plus the value loss and values of a shared
actor-critic), a separate critic's value loss and values.

Each length-bucketed micro-batch of a mini-batch runs one 1F1B schedule, its rows split into
`pp` pipeline micro-batches (padded to a multiple of pp with copies of the first row that
carry no loss). The loss is the one process's (`objective.TokenLoss`, `value.value_loss`),
computed on the last stage from its outputs and the per-token inputs the schedule slices
alongside the rows; its statistics are broadcast from there.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlloom.algos.aggregation import AGGREGATIONS, LossNorm
from rlloom.algos.value import value_loss
from rlloom.config import AlgoSection, RunConfig
from rlloom.models.logprobs import token_logprobs
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.rollout.generate import Rollout
from rlloom.runtime.stages.batch import joined
from rlloom.runtime.stages.objective import micro_rows, token_loss
from rlloom.runtime.stages.packing import Agree

if TYPE_CHECKING:
    from rlloom.runtime.stages.experience import Experience

# the per-token inputs of the loss, in the order they are packed into the schedule's target
# (a shared actor-critic's value loss adds the old values and the returns)
FIELDS = ("token", "old_logp", "advantage", "mask", "ref_logp", "old_value", "return")


def _split(pipe: PipelinedModel, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last stage's final hidden states and, for a shared actor-critic, its values (the
    channel the stage appends to them)."""
    if pipe.module.both:
        return out[..., :-1], out[..., -1]
    return out, None


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with copies of its first row appended up to `rows` rows."""
    extra = rows - x.shape[0]
    return torch.cat([x, x[:1].expand(extra, *x.shape[1:])]) if extra else x


def pipeline_rows(pipe: PipelinedModel, n: int) -> int:
    """`n` rows rounded up to a multiple of the pipeline's micro-batches."""
    m = pipe.n_microbatches
    return -(-n // m) * m


def _logprobs(pipe: PipelinedModel, hidden: torch.Tensor, tokens: torch.Tensor,
              temperature: float, with_entropy: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `tokens` (and entropies) from the last stage's hidden states, as
    `batch.response_logprobs` computes them: the head a chunk of tokens at a time."""
    return token_logprobs(pipe.module.lm_head, hidden, tokens, temperature, with_entropy)


def pipelined_backward(pipe: PipelinedModel, exp: Experience, idx: torch.Tensor,
                       norm: LossNorm, kl_coef: float, cfg: RunConfig,
                       micro_batch_tokens: int | None, agree: Agree | None = None
                       ) -> dict[str, float]:
    """`online.policy_backward` for a pipelined actor: accumulate the gradient of mini-batch
    `idx`'s loss into this stage's parameters (tied embeddings summed over their two stages)
    and return the statistics on every rank of the pipeline."""
    a = cfg.algo
    objective = token_loss(exp, norm, kl_coef, cfg)
    sums = objective.sums()
    if pipe.module.both:
        sums["value_loss"] = 0.0
    for _, rows, mb, t in micro_rows(exp, idx, micro_batch_tokens, agree=agree):
        ids, mask, span = joined(mb)
        ref = exp.ref_logp[rows, :t] if exp.ref_logp is not None else torch.zeros_like(
            mb.logprobs)
        parts = (mb.response_ids, mb.logprobs, exp.advantages[rows, :t],
                 exp.loss_mask[rows, :t], ref)
        if pipe.module.both:
            parts += (exp.old_values[rows, :t], exp.returns[rows, :t])
        dtypes = [p.dtype for p in parts]
        target = torch.stack([p.double() for p in parts], -1)   # [rows, T, fields]
        n, padded = len(rows), pipeline_rows(pipe, len(rows))
        ids, mask, target = (padded_rows(x, padded) for x in (ids, mask, target))
        target[n:, :, FIELDS.index("mask")] = 0.0

        def loss_fn(out: torch.Tensor, target: torch.Tensor, span: slice = span,
                    dtypes: list[torch.dtype] = dtypes) -> torch.Tensor:
            token, old, adv, keep, ref, *value_terms = (target[..., i].to(d)
                                                        for i, d in enumerate(dtypes))
            hidden, values = _split(pipe, out)
            logp, entropy = _logprobs(pipe, hidden[:, span], token, cfg.rollout.temperature,
                                      with_entropy=True)
            loss = objective(logp, entropy, old, adv, keep,
                             ref if exp.ref_logp is not None else None, sums)
            if values is None:
                return loss
            old_values, returns = value_terms
            vloss = AGGREGATIONS.get(a.loss_agg)(value_loss(
                values[:, span], old_values, returns, keep, a.value_clip), keep, norm)
            sums["value_loss"] += vloss.item()
            return loss + a.vf_coef * vloss
        sums["loss"] += float(pipe.train_step(ids, mask, target, loss_fn))
    pipe.sync_tied_grads()
    keys = sorted(sums)
    stats = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=pipe.device)
    dist.broadcast(stats, src=pipe.last_rank, group=pipe.group)  # summed on the last stage
    return objective.means(dict(zip(keys, stats.tolist())))


def pipelined_critic_backward(pipe: PipelinedModel, exp: Experience, idx: torch.Tensor,
                              norm: LossNorm, algo: AlgoSection,
                              micro_batch_tokens: int | None, agree: Agree | None = None
                              ) -> float:
    """`online.critic_backward` for a pipelined critic: accumulate mini-batch `idx`'s value-loss
    gradient into this stage's parameters; the loss, on every rank of the pipeline."""
    aggregate = AGGREGATIONS.get(algo.loss_agg)
    total = 0.0
    for _, rows, mb, t in micro_rows(exp, idx, micro_batch_tokens, agree=agree):
        ids, mask, span = joined(mb)
        parts = (exp.old_values[rows, :t], exp.returns[rows, :t], exp.loss_mask[rows, :t])
        dtypes = [p.dtype for p in parts]
        target = torch.stack([p.double() for p in parts], -1)   # [rows, T, 3]
        n, padded = len(rows), pipeline_rows(pipe, len(rows))
        ids, mask, target = (padded_rows(x, padded) for x in (ids, mask, target))
        target[n:, :, 2] = 0.0

        def loss_fn(values: torch.Tensor, target: torch.Tensor, span: slice = span,
                    dtypes: list[torch.dtype] = dtypes) -> torch.Tensor:
            old, returns, keep = (target[..., i].to(d) for i, d in enumerate(dtypes))
            return aggregate(value_loss(values[:, span], old, returns, keep,
                                        algo.value_clip), keep, norm)
        total += float(pipe.train_step(ids, mask, target, loss_fn))
    return total


@torch.no_grad()
def _scored(pipe: PipelinedModel, r: Rollout,
            head: Callable[[torch.Tensor, slice], torch.Tensor], dtype: torch.dtype
            ) -> torch.Tensor:
    """`head(last stage's outputs of the rows, response span)` [n, T] of a forward-only pass,
    broadcast from the last stage to every rank of the pipeline."""
    ids, mask, span = joined(r)
    n = len(ids)
    padded = pipeline_rows(pipe, n)
    outputs = pipe.score(padded_rows(ids, padded), padded_rows(mask, padded))
    out = torch.zeros(r.response_ids.shape, dtype=dtype, device=pipe.device)
    if pipe.is_last:
        out = head(outputs[:n], span).to(dtype).contiguous()
    dist.broadcast(out, src=pipe.last_rank, group=pipe.group)
    return out


def pipelined_logprobs(pipe: PipelinedModel, r: Rollout, temperature: float) -> torch.Tensor:
    """Response log-probs [n, T] of a pipelined actor (forward only), on every rank."""
    return _scored(pipe, r, lambda out, span: _logprobs(
        pipe, _split(pipe, out)[0][:, span], r.response_ids, temperature)[0], torch.float32)


def pipelined_values(pipe: PipelinedModel, r: Rollout) -> torch.Tensor:
    """A pipelined critic's (or shared actor-critic's) values [n, T] of the state before each
    response token, on every rank of the pipeline."""
    return _scored(pipe, r, lambda out, span: (_split(pipe, out)[1] if pipe.module.both
                                               else out)[:, span], pipe.dtype)
