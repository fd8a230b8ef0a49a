"""Training micro-batches by length: sort the rows of a mini-batch, cut them into groups of
similar length under a token budget, and trim each group to its own widths.

Rows of similar length share a micro-batch, so little compute goes to padding, and the
budget bounds activation memory. The loss normalisers come from the whole mini-batch
(`algos.aggregation.LossNorm`), so the summed micro-batch gradients equal the mini-batch
gradient however the rows are split.
"""
from __future__ import annotations

import torch

from rlloom.perf.buckets import split_sorted
from rlloom.rollout.generate import Rollout


def micro_batches(prompt_lens: torch.Tensor, response_lens: torch.Tensor, budget: int | None,
                  prompts_done: bool = False) -> list[torch.Tensor]:
    """Positions of rows [n] grouped into micro-batches, shortest rows first, cut where
    `perf.buckets.split_sorted` says (least padding plus per-micro-batch overhead) under a
    `budget` of padded tokens (`train.micro_batch_tokens`); None: all rows in one.
    `prompts_done`: the prompts ran in a shared pass; sort and cost by the responses."""
    order = torch.sort(response_lens if prompts_done else prompt_lens + response_lens,
                       stable=True).indices
    if budget is None:
        return [order]
    bounds = split_sorted(prompt_lens[order].tolist(), response_lens[order].tolist(), budget,
                          prompts_done=prompts_done)
    return [order[s:e] for s, e in bounds]


def trim(r: Rollout) -> Rollout:
    """The rows without columns that are padding in every row (left of the prompts, right of
    the responses). Positions come from the masks, so outputs do not change."""
    p = max(int(r.prompt_mask.sum(1).max()), 1)
    t = max(int(r.response_mask.sum(1).max()), 1)
    return Rollout(r.prompt_ids[:, -p:], r.prompt_mask[:, -p:], r.response_ids[:, :t],
                   r.response_mask[:, :t], r.logprobs[:, :t], r.finished)
