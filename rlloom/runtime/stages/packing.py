"""Training micro-batches by length: sort the rows of a mini-batch, cut them into groups of
similar length under a token budget, and trim each group to its own widths.

Rows of similar length share a micro-batch, so little compute goes to padding, and the
budget bounds activation memory. The loss normalisers come from the whole mini-batch
(`algos.aggregation.LossNorm`), so the summed micro-batch gradients equal the mini-batch
gradient however the rows are split.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from rlloom.perf.model.buckets import split_sorted
from rlloom.rollout.generate import Rollout

Agree = Callable[[int], int]


def micro_batches(prompt_lens: torch.Tensor, response_lens: torch.Tensor, budget: int | None,
                  prompts_done: bool = False, agree: Agree | None = None) -> list[torch.Tensor]:
    """Positions of rows [n] grouped into micro-batches, shortest rows first, cut where
    `perf.model.buckets.split_sorted` says (least padding plus per-micro-batch overhead) under a
    `budget` of padded tokens (`train.micro_batch_tokens`); None: all rows in one.
    `prompts_done`: the prompts ran in a shared pass; sort and cost by the responses.
    `agree` maps this rank's micro-batch count to the one every rank runs (under torchrun the
    ranks' largest, so that their passes and the collectives inside them pair up); the cut is
    then refined to that many micro-batches, each still within the budget."""
    order = torch.sort(response_lens if prompts_done else prompt_lens + response_lens,
                       stable=True).indices
    if budget is None:
        bounds = [(0, len(order))]
    else:
        bounds = split_sorted(prompt_lens[order].tolist(), response_lens[order].tolist(), budget,
                              prompts_done=prompts_done)
    if agree is not None:
        bounds = _refine(bounds, agree(len(bounds)))
    return [order[s:e] for s, e in bounds]


def _refine(bounds: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """`count` micro-batches from `bounds` by halving the one with the most rows (fewer rows
    never pad more, so every part stays within the budget)."""
    bounds = list(bounds)
    if count > bounds[-1][1] - bounds[0][0]:
        raise ValueError(f"{count} micro-batches of {bounds[-1][1] - bounds[0][0]} rows: every "
                         "rank must hold as many rows")
    while len(bounds) < count:
        i = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
        s, e = bounds[i]
        bounds[i:i + 1] = [(s, (s + e) // 2), ((s + e) // 2, e)]
    return bounds


def trim(r: Rollout) -> Rollout:
    """The rows without columns that are padding in every row (left of the prompts, right of
    the responses). Positions come from the masks, so outputs do not change."""
    p = max(int(r.prompt_mask.sum(1).max()), 1)
    t = max(int(r.response_mask.sum(1).max()), 1)
    width = r.prompt_ids.shape[1]
    return Rollout(r.prompt_ids[:, -p:], r.prompt_mask[:, -p:], r.response_ids[:, :t],
                   r.response_mask[:, :t], r.logprobs[:, :t], r.finished,
                   None if r.injected is None else r.injected[:, :t],
                   None if r.routes is None else r.routes[:, width - p:width + t])
