"""Truncated importance sampling between the sampler and the trainer, by hand."""
import math

import pytest
import torch

from rlloom.algos.rollout_correction import mismatch_stats, recomputes_behaviour, tis_weights

TRAINER = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
SAMPLER = torch.tensor([[-1.1, -1.5, 9.0], [-0.5, -1.0, -0.2]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
E = math.exp


def test_token_tis_caps_each_token_ratio():
    # trainer / sampler per token: e^0.1, e^-0.5 | 1, e^0.5 (capped at 1.5), e^-0.3
    expected = [[E(0.1), E(-0.5), 0.0], [1.0, 1.5, E(-0.3)]]
    torch.testing.assert_close(tis_weights(TRAINER, SAMPLER, MASK, "token_tis", 1.5),
                               torch.tensor(expected, dtype=torch.float64))


def test_seq_tis_caps_the_sequence_ratio():
    # sequence log-ratios: 0.1 - 0.5 = -0.4 and 0 + 0.5 - 0.3 = 0.2
    expected = [[E(-0.4), E(-0.4), 0.0], [E(0.2)] * 3]
    torch.testing.assert_close(tis_weights(TRAINER, SAMPLER, MASK, "seq_tis", 1.5),
                               torch.tensor(expected, dtype=torch.float64))
    capped = tis_weights(TRAINER, SAMPLER, MASK, "seq_tis", 1.1)
    assert capped[1].tolist() == [1.1, 1.1, 1.1]


def test_mismatch_statistics():
    weights = tis_weights(TRAINER, SAMPLER, MASK, "token_tis", 1.5)
    stats = mismatch_stats(TRAINER, SAMPLER, MASK, weights, 1.5)
    # sampler - trainer on the 5 valid tokens: -0.1, 0.5, 0, -0.5, 0.3
    assert stats["mismatch_k1"] == pytest.approx(0.2 / 5)
    assert stats["mismatch_max_ratio"] == pytest.approx(E(0.5))
    assert stats["tis_mean"] == pytest.approx((E(0.1) + E(-0.5) + 1 + 1.5 + E(-0.3)) / 5)
    assert stats["tis_capped"] == pytest.approx(1 / 5)


def test_none_weighs_every_valid_token_one():
    assert tis_weights(TRAINER, SAMPLER, MASK, "none", 1.5).tolist() == MASK.tolist()


@pytest.mark.parametrize("engine, mode, recomputes", [
    ("vllm", "none", True), ("rlloom", "none", False), ("rlloom", "token_tis", True),
    ("plain", "seq_tis", True)])
def test_who_recomputes(engine, mode, recomputes):
    assert recomputes_behaviour(engine, mode) is recomputes
