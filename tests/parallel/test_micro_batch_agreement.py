"""In a group of ranks every rank must run as many micro-batches as the others, or the
collectives inside their passes (gradient sync, ZeRO-3 gathers) would pair up wrongly and hang."""
import torch
import torch.distributed as dist
from harness import spawn

from rlloom.runtime.ranks import RankGroup
from rlloom.runtime.stages.packing import micro_batches

BUDGET = 60


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's 8 rows fit one micro-batch; rank 1's include long rows that need several."""
    prompts = torch.full((8,), 5)
    responses = torch.tensor([1, 1, 2, 2, 1, 2, 1, 2]) if rank == 0 else \
        torch.tensor([2, 3, 10, 40, 4, 45, 3, 2])
    return prompts, responses


def _cut() -> dict:
    rank = dist.get_rank()
    prompts, responses = _rows(rank)
    local = len(micro_batches(prompts, responses, BUDGET))
    ranks = RankGroup.join(torch.device("cpu"), world=dist.get_world_size())
    parts = micro_batches(prompts, responses, BUDGET, agree=ranks.agree())
    for part in parts:  # one collective per micro-batch, as a ZeRO-3 forward would issue
        dist.all_reduce(torch.tensor([len(part)]))
    widths = [len(p) * int((prompts[p] + responses[p]).max()) for p in parts]
    return {"local": local, "parts": len(parts), "rows": sorted(torch.cat(parts).tolist()),
            "widths": widths}


def test_ranks_run_the_largest_micro_batch_count():
    r0, r1 = spawn(_cut, 2)
    assert r0["local"] == 1 and r1["local"] >= 3  # they disagree before agreeing
    assert r0["parts"] == r1["parts"] == r1["local"]
    for r in (r0, r1):
        assert r["rows"] == list(range(8))  # every row once
        assert all(w <= BUDGET for w in r["widths"])
