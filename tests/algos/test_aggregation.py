import math

import pytest
import torch

from rlloom.algos.aggregation import AGGREGATIONS, LossNorm

D = torch.float64
# Row 0 has 2 valid tokens (1 + 2 = 3), row 1 has 1 (4); padded entries must never count.
LOSS = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=D)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),                       # (3 + 4) / 3 tokens
    ("seq-mean-token-sum", 7 / 2),               # (3 + 4) / 2 sequences
    ("seq-mean-token-mean", (3 / 2 + 4 / 1) / 2),  # per-sequence means 1.5 and 4, / 2 sequences
    ("seq-mean-token-sum-norm", 7 / (2 * 4)),    # (3 + 4) / (2 sequences * const 4)
])
def test_aggregation_by_hand(mode, expected):
    out = AGGREGATIONS.get(mode)(LOSS, MASK, LossNorm.of(MASK, const=4.0))
    assert out.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 10),
    ("seq-mean-token-sum", 7 / 5),
    ("seq-mean-token-mean", 5.5 / 5),
    ("seq-mean-token-sum-norm", 7 / (5 * 2)),
])
def test_normalisers_are_the_whole_mini_batch(mode, expected):
    # this micro-batch is part of a mini-batch of 10 tokens in 5 sequences
    out = AGGREGATIONS.get(mode)(LOSS, MASK, LossNorm(tokens=10, seqs=5, const=2))
    assert out.item() == pytest.approx(expected, rel=1e-12)


def test_empty_sequence_adds_zero_to_seq_mean_token_mean():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=D)
    out = AGGREGATIONS.get("seq-mean-token-mean")(LOSS, mask, LossNorm(tokens=2, seqs=2))
    assert out.item() == pytest.approx(1.5 / 2, rel=1e-12)
    assert math.isfinite(out.item())


@pytest.mark.parametrize("mode", AGGREGATIONS.names())
def test_padding_never_contributes(mode):
    loss = LOSS.clone().requires_grad_(True)
    poisoned = torch.where(MASK > 0, LOSS, torch.tensor(float("nan"), dtype=D)).requires_grad_(True)
    norm = LossNorm.of(MASK, const=3.0)
    clean = AGGREGATIONS.get(mode)(loss, MASK, norm)
    dirty = AGGREGATIONS.get(mode)(poisoned, MASK, norm)
    assert clean.item() == dirty.item()
    clean.backward()
    dirty.backward()
    assert torch.equal(loss.grad, poisoned.grad)
    assert not loss.grad[MASK == 0].any()


def test_loss_norm_refuses_an_empty_mini_batch():
    with pytest.raises(ValueError, match="positive"):
        LossNorm(tokens=0, seqs=4)
    assert LossNorm.of(MASK) == LossNorm(tokens=3.0, seqs=2.0, const=1.0)
