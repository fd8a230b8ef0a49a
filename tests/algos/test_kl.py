import math

import pytest
import torch

from rlloom.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_shaped_rewards,
)

D = torch.float64


def test_kl_estimators_by_hand():
    # pi = .5, ref = .25: k1 = log .5 - log .25 = log 2; k2 = .5 (log 2)^2;
    # k3 = r - log r - 1 with r = ref/pi = .5 -> .5 + log 2 - 1
    logp, ref = torch.tensor([math.log(0.5)], dtype=D), torch.tensor([math.log(0.25)], dtype=D)
    torch.testing.assert_close(KL_ESTIMATORS.get("k1")(logp, ref),
                               torch.tensor([math.log(2)], dtype=D))
    torch.testing.assert_close(KL_ESTIMATORS.get("k2")(logp, ref),
                               torch.tensor([0.5 * math.log(2) ** 2], dtype=D))
    torch.testing.assert_close(KL_ESTIMATORS.get("k3")(logp, ref),
                               torch.tensor([0.5 + math.log(2) - 1], dtype=D))


def test_k3_clamps_the_log_ratio():
    # log(ref/pi) = -100 and +100 are clamped to -20 and 20: e^-20 + 20 - 1 and e^20 - 20 - 1
    logp = torch.tensor([0.0, 0.0], dtype=D)
    ref = torch.tensor([-100.0, 100.0], dtype=D)
    expected = torch.tensor([math.exp(-20) + 19, math.exp(20) - 21], dtype=D)
    torch.testing.assert_close(KL_ESTIMATORS.get("k3")(logp, ref), expected)


def test_k3_is_non_negative_and_k1_k2_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 33, generator=g, dtype=D) * 3
    ref = torch.randn(64, 33, generator=g, dtype=D) * 3
    assert (KL_ESTIMATORS.get("k3")(logp, ref) >= 0).all()
    assert (KL_ESTIMATORS.get("k2")(logp, ref) >= 0).all()
    # k3 of identical distributions is exactly 0
    assert torch.equal(KL_ESTIMATORS.get("k3")(logp, logp), torch.zeros_like(logp))


def test_kl_shaped_rewards_by_hand():
    # k1 per token = logp - ref = [[.1, .2, .3], [.4, .5, pad]]; coef .5 ->
    # row 0: [-.05, -.1, -.15 + 2]; row 1 (2 tokens): [-.2, -.25 + 1, 0]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    ref = torch.zeros(2, 3, dtype=D)
    logp = torch.tensor([[.1, .2, .3], [.4, .5, 1e6]], dtype=D)
    scores = torch.tensor([2.0, 1.0], dtype=D)
    rewards = kl_shaped_rewards(scores, mask, logp, ref, coef=0.5, estimator="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-.05, -.1, 1.85], [-.2, .75, 0]], dtype=D))
    # coef 0: only the score on the last valid token
    plain = kl_shaped_rewards(scores, mask, logp, ref, coef=0.0, estimator="k3")
    torch.testing.assert_close(plain, torch.tensor([[0, 0, 2], [0, 1, 0]], dtype=D))


def test_kl_shaped_rewards_sum_to_score_minus_kl():
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1]])).to(D)
    logp, ref = torch.randn(3, 6, generator=g, dtype=D), torch.randn(3, 6, generator=g, dtype=D)
    scores = torch.tensor([1.0, 0.0, -1.0], dtype=D)
    rewards = kl_shaped_rewards(scores, mask, logp, ref, coef=0.1, estimator="k2")
    kl = (0.5 * (logp - ref) ** 2 * mask).sum(1)
    torch.testing.assert_close(rewards.sum(1), scores - 0.1 * kl)
    assert not rewards[mask == 0].any()


def test_adaptive_kl_controller_by_hand():
    # target 6, horizon 10000, 100 steps per update:
    # kl 12 -> error clip(12/6 - 1 = 1) = .2 -> coef .1 * (1 + .2 * 100 / 10000) = .1002
    # kl 6.6 -> error .1 -> .1002 * (1 + .1 * .01) = .1002 * 1.001
    # kl 0 -> error clip(-1) = -.2 -> * (1 - .002)
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(12.0, n_steps=100)
    assert ctl.value == pytest.approx(0.1002, rel=1e-12)
    ctl.update(6.6, n_steps=100)
    assert ctl.value == pytest.approx(0.1002 * 1.001, rel=1e-12)
    ctl.update(0.0, n_steps=100)
    assert ctl.value == pytest.approx(0.1002 * 1.001 * 0.998, rel=1e-12)
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=10000)


def test_fixed_kl_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, n_steps=1000)
    assert ctl.value == 0.05
