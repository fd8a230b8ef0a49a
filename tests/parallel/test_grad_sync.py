"""Gradient accumulation over micro-batches under data parallelism (`before_backward`):
replicas (ZeRO-0) all-reduce once a step, ZeRO-2 gathers its parameters once a step, and
the accumulated gradients equal one process's (float64, 1e-10).

The collectives are counted by wrapping the torch.distributed functions FSDP2 calls, in the
same run with the deferral and with a reduction in every backward.
"""
from collections import Counter

import pytest
import torch.distributed as dist
from harness import batch, full, loss_sum, n_tokens, reference_step, spawn, tiny_model

from rlloom.parallel.apply import parallelize
from rlloom.parallel.data_parallel import before_backward
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout

COUNTED = ("all_reduce", "all_gather_single", "reduce_scatter_single")


def _accumulate(zero: int, defer: bool) -> tuple[Counter, float]:
    """Two micro-batches of this rank's two rows; the collectives of the loop and the largest
    gradient difference from one process."""
    layout = Layout(dp=2, zero=zero)
    model = parallelize(tiny_model(0), layout, build_mesh(layout), mixed_precision=False)
    ids, mask = batch()
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COUNTED}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call
    for name in COUNTED:
        setattr(dist, name, counting(name))
    try:
        for j in range(2):
            rows = slice(mine.start + j, mine.start + j + 1)
            loss = loss_sum(model, ids[rows], mask[rows]) / n_tokens(mask) * layout.dp
            if defer:
                before_backward(model, last=j == 1)
            loss.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    ref = reference_step(0)["grads"]
    err = max((full(p.grad) - ref[n]).abs().max().item() for n, p in model.named_parameters())
    return counts, err


def _body(zero: int) -> dict:
    return {defer: _accumulate(zero, defer) for defer in (True, False)}


@pytest.mark.parametrize("zero", [0, 2])
def test_data_parallel_reduces_once_a_step_and_matches_one_process(zero):
    for res in spawn(_body, 2, zero):
        (once, err_once), (every, err_every) = res[True], res[False]
        assert err_once < 1e-10 and err_every < 1e-10
        if zero == 0:   # one all-reduce per wrapped module, in the last backward only
            assert every["all_reduce"] == 2 * once["all_reduce"] > 0
        else:           # parameters gathered in the first forward only; grads scattered twice
            assert every["all_gather_single"] == 2 * once["all_gather_single"] > 0
            assert every["reduce_scatter_single"] == once["reduce_scatter_single"] > 0
