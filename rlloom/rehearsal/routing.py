"""Routing on fake tensors: which tokens an MoE router picks is data, and fake tensors have
none, so a rehearsal routes evenly (every expert, and every expert-parallel rank, gets the
same number of rows), as the cost model assumes. The runtime's own code runs around the two
data-dependent steps it replaces."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from rlloom.parallel.expert_parallel import ExpertParallelMoE


def _even_rows(expert_ids: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
    return list(torch.arange(expert_ids.shape[0]).chunk(len(experts)))


def _even_splits(block: ExpertParallelMoE, expert: torch.Tensor
                 ) -> tuple[list[int], list[int], torch.Tensor]:
    per_rank = expert.shape[0] // block.ep
    local = torch.arange(block.first, block.first + block.n_local)
    # the all-to-all of counts still runs, as the runtime's does
    counts = torch.full((block.n_experts,), per_rank // block.n_local, dtype=torch.long)
    torch.distributed.all_to_all_single(torch.empty_like(counts), counts, group=block.group)
    return [per_rank] * block.ep, [per_rank] * block.ep, \
        local.repeat_interleave(per_rank // block.n_local).repeat(block.ep)


@contextlib.contextmanager
def even_routing() -> Iterator[None]:
    with mock.patch("rlloom.models.moe.rows_by_expert", _even_rows), \
            mock.patch.object(ExpertParallelMoE, "splits", _even_splits):
        yield
