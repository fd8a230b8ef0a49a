import math
import statistics

import pytest
import torch

from rlloom.algos.advantages import ADVANTAGES, GRPO_EPS, AdvantageInputs

D = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


# Six samples, two prompts with non-contiguous ids (7: four samples, 3: two samples). Masked
# positions hold garbage (5, 7, 9) that must never be read.
MASK = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
REWARDS = t([[0, 0, 1],            # s = 1
             [0, 0, 5],            # s = 0 (the 5 is padding)
             [0, 7, 7],            # s = 0
             [0.5, -0.5, 1],       # s = 1: KL shaping on every token sums to 0 here
             [0, 1, 9],            # s = 1
             [0, 0, 1]])           # s = 1
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3])


def inputs(**kw) -> AdvantageInputs:
    return AdvantageInputs(token_rewards=REWARDS, mask=MASK, group_ids=GROUPS, **kw)


def test_grpo_by_hand():
    # group 7 scores [1, 0, 0, 1]: mean .5, unbiased var (4 * .25) / 3 = 1/3, std sqrt(1/3);
    # a = .5 / (sqrt(1/3) + 1e-6). Group 3 scores [1, 1]: all equal, advantage 0.
    a = 0.5 / (math.sqrt(1 / 3) + GRPO_EPS)
    adv, ret = ADVANTAGES.get("grpo")(inputs())
    expected = t([[a, a, a], [-a, -a, 0], [-a, 0, 0], [a, a, a], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_dr_grpo_by_hand():
    # s - group mean: group 7 -> [.5, -.5, -.5, .5]; group 3 -> [0, 0]
    adv, ret = ADVANTAGES.get("dr_grpo")(inputs())
    expected = t([[.5, .5, .5], [-.5, -.5, 0], [-.5, 0, 0], [.5, .5, .5], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_rloo_by_hand():
    # s_i - mean of the other three: 1 - (0+0+1)/3 = 2/3; 0 - (1+0+1)/3 = -2/3; group 3: 1-1=0
    b = 2 / 3
    adv, ret = ADVANTAGES.get("rloo")(inputs())
    expected = t([[b, b, b], [-b, -b, 0], [-b, 0, 0], [b, b, b], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_of_one_is_refused(name):
    singleton = torch.tensor([0, 0, 0, 1, 1, 2])
    x = AdvantageInputs(token_rewards=REWARDS, mask=MASK, group_ids=singleton)
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        ADVANTAGES.get(name)(x)


def test_remax_by_hand():
    # s - greedy baseline: [1-.5, 0-.5, 0-.5, 1-.5, 1-1, 1-0]
    adv, ret = ADVANTAGES.get("remax")(inputs(baseline_rewards=t([.5, .5, .5, .5, 1, 0])))
    expected = t([[.5, .5, .5], [-.5, -.5, 0], [-.5, 0, 0], [.5, .5, .5], [0, 0, 0], [1, 1, 1]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    with pytest.raises(ValueError, match="baseline_rewards"):
        ADVANTAGES.get("remax")(inputs())


def whitened(values: list[float]) -> list[float]:
    """(v - mean) / sqrt(population variance + 1e-8), written independently of the library."""
    mean, var = statistics.fmean(values), statistics.pvariance(values)
    return [(v - mean) / (var + 1e-8) ** 0.5 for v in values]


def test_reinforce_pp_by_hand():
    # gamma .5. Row 0 rewards [-.1, -.1, 1]: G2 = 1, G1 = -.1 + .5 * 1 = .4, G0 = -.1 + .5 * .4
    # = .1. Row 1 (2 tokens) rewards [.2, 0, pad 9]: G1 = 0, G0 = .2. Whitened over the five
    # valid G [.1, .4, 1, .2, 0]: mean .34, population var .632 / 5 = .1264.
    x = AdvantageInputs(token_rewards=t([[-.1, -.1, 1], [.2, 0, 9]]),
                        mask=t([[1, 1, 1], [1, 1, 0]]), group_ids=torch.tensor([0, 0]), gamma=0.5)
    adv, ret = ADVANTAGES.get("reinforce_pp")(x)
    torch.testing.assert_close(ret, t([[.1, .4, 1], [.2, 0, 0]]))
    w = whitened([.1, .4, 1, .2, 0])
    assert abs(statistics.pstdev([.1, .4, 1, .2, 0]) - math.sqrt(.1264)) < 1e-12
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0]]))


def test_reinforce_pp_baseline_by_hand():
    # Same rows, one group, gamma 1. Scores .8 and .2, group mean .5, subtracted from each
    # last valid reward: row 0 [-.1, -.1, .5], row 1 [.2, -.5]. G: row 0 [.3, .4, .5],
    # row 1 [-.3, -.5]. Whitened over [.3, .4, .5, -.3, -.5]: mean .08, population var .1616.
    x = AdvantageInputs(token_rewards=t([[-.1, -.1, 1], [.2, 0, 9]]),
                        mask=t([[1, 1, 1], [1, 1, 0]]), group_ids=torch.tensor([0, 0]))
    adv, ret = ADVANTAGES.get("reinforce_pp_baseline")(x)
    torch.testing.assert_close(ret, t([[.3, .4, .5], [-.3, -.5, 0]]))
    w = whitened([.3, .4, .5, -.3, -.5])
    assert abs(statistics.pstdev([.3, .4, .5, -.3, -.5]) - math.sqrt(.1616)) < 1e-12
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0]]))


def test_gae_by_hand():
    # gamma .9, lam .8 (gamma * lam = .72).
    # Row 0: r [0, 0, 1], V [.5, .6, .7], V after the end = 0.
    #   delta2 = 1 + .9*0 - .7 = .3; delta1 = 0 + .9*.7 - .6 = .03; delta0 = .9*.6 - .5 = .04
    #   A2 = .3; A1 = .03 + .72*.3 = .246; A0 = .04 + .72*.246 = .21712
    #   returns = A + V = [.71712, .846, 1.0]
    # Row 1 (2 tokens): r [0, .5, pad 9], V [.2, .4, pad 100].
    #   delta1 = .5 - .4 = .1; delta0 = .9*.4 - .2 = .16; A1 = .1; A0 = .16 + .72*.1 = .232
    #   returns = [.432, .5]
    x = AdvantageInputs(token_rewards=t([[0, 0, 1], [0, .5, 9]]), mask=t([[1, 1, 1], [1, 1, 0]]),
                        group_ids=torch.tensor([0, 1]), values=t([[.5, .6, .7], [.2, .4, 100]]),
                        gamma=0.9, lam=0.8)
    adv, ret = ADVANTAGES.get("gae")(x)
    torch.testing.assert_close(ret, t([[.71712, .846, 1.0], [.432, .5, 0]]))
    w = whitened([.21712, .246, .3, .232, .1])
    torch.testing.assert_close(adv, t([[w[0], w[1], w[2]], [w[3], w[4], 0]]))
    with pytest.raises(ValueError, match="critic values"):
        ADVANTAGES.get("gae")(AdvantageInputs(x.token_rewards, x.mask, x.group_ids))


def test_gae_skips_holes_in_the_mask():
    # A masked position in the middle (e.g. a tool's output) is skipped: the result on the
    # valid tokens equals GAE on the sequence with the hole removed.
    holed = AdvantageInputs(token_rewards=t([[.1, 3, .2, 1]]), mask=t([[1, 0, 1, 1]]),
                            group_ids=torch.tensor([0]), values=t([[.5, -4, .3, .6]]),
                            gamma=0.9, lam=0.8)
    packed = AdvantageInputs(token_rewards=t([[.1, .2, 1]]), mask=t([[1, 1, 1]]),
                             group_ids=torch.tensor([0]), values=t([[.5, .3, .6]]),
                             gamma=0.9, lam=0.8)
    for name in ("gae", "reinforce_pp"):
        adv_h, ret_h = ADVANTAGES.get(name)(holed)
        adv_p, ret_p = ADVANTAGES.get(name)(packed)
        torch.testing.assert_close(adv_h[:, [0, 2, 3]], adv_p)
        torch.testing.assert_close(ret_h[:, [0, 2, 3]], ret_p)
        assert adv_h[0, 1] == 0 and ret_h[0, 1] == 0


def random_batch(seed: int, groups: int = 5, k: int = 4, length: int = 7) -> AdvantageInputs:
    g = torch.Generator().manual_seed(seed)
    n = groups * k
    lengths = torch.randint(1, length + 1, (n,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).to(D)
    rewards = torch.randn(n, length, generator=g, dtype=D) * 0.1
    shuffled = torch.arange(groups).repeat_interleave(k)[torch.randperm(n, generator=g)]
    return AdvantageInputs(token_rewards=rewards, mask=mask, group_ids=shuffled,
                           values=torch.randn(n, length, generator=g, dtype=D),
                           baseline_rewards=torch.randn(n, generator=g, dtype=D),
                           gamma=0.95, lam=0.9)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_sum_to_zero(name):
    x = random_batch(0)
    adv, _ = ADVANTAGES.get(name)(x)
    per_sample = adv[:, 0]  # every sample has its first token, and the value is constant per row
    for gid in x.group_ids.unique():
        assert abs(per_sample[x.group_ids == gid].sum().item()) < 1e-12


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_whitened_advantages_have_zero_mean_unit_std(name):
    x = random_batch(1)
    adv, _ = ADVANTAGES.get(name)(x)
    flat = adv[x.mask > 0]
    assert abs(flat.mean().item()) < 1e-12
    assert abs(flat.std(unbiased=False).item() - 1) < 1e-6


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_padding_never_contributes(name):
    x = random_batch(2)
    pad = x.mask == 0
    garbage = torch.full_like(x.token_rewards, 1e6)
    y = AdvantageInputs(token_rewards=torch.where(pad, garbage, x.token_rewards), mask=x.mask,
                        group_ids=x.group_ids, values=torch.where(pad, -garbage, x.values),
                        baseline_rewards=x.baseline_rewards, gamma=x.gamma, lam=x.lam)
    adv_x, ret_x = ADVANTAGES.get(name)(x)
    adv_y, ret_y = ADVANTAGES.get(name)(y)
    assert torch.equal(adv_x, adv_y) and torch.equal(ret_x, ret_y)
    assert not adv_x[pad].any() and not ret_x[pad].any()


def test_outputs_carry_no_gradient():
    x = random_batch(3)
    x.values.requires_grad_(True)
    adv, ret = ADVANTAGES.get("gae")(x)
    assert not adv.requires_grad and not ret.requires_grad


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="group_ids"):
        AdvantageInputs(token_rewards=REWARDS, mask=MASK, group_ids=torch.tensor([0, 1]))


def _constant(value: float, k: int, groups: int = 3) -> AdvantageInputs:
    """`groups` prompts x `k` samples in float32, every score equal to `value` (on the last
    of 4 tokens, 3 of them valid) and the first group's varying 0/1, so only the constant
    groups must come out 0."""
    n = groups * k
    rewards = torch.zeros(n, 4, dtype=torch.float32)
    rewards[:, 2] = value
    rewards[:k, 2] = torch.arange(k, dtype=torch.float32) % 2
    mask = torch.tensor([[1, 1, 1, 0]] * n, dtype=torch.float32)
    return AdvantageInputs(rewards, mask, torch.arange(n) // k, gamma=1.0)


@pytest.mark.parametrize("value", [0.7, 1 / 3, 0.1, 2 / 3, 7 / 11, 1e-7, 12345.678])
@pytest.mark.parametrize("k", [8, 16])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_group_of_equal_scores_gets_exactly_zero_in_float32(name, k, value):
    x = _constant(value, k)
    adv, _ = ADVANTAGES.get(name)(x)
    assert adv.dtype == torch.float32
    assert torch.count_nonzero(adv[k:]) == 0, adv[k:].abs().max()
    assert torch.count_nonzero(adv[:k]) > 0  # the varying group still learns


@pytest.mark.parametrize("value", [0.7, 1 / 3, 7 / 11])
@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_whitening_a_constant_batch_gives_exactly_zero(name, value):
    x = _constant(value, 8)
    x.token_rewards[:8, 2] = value  # every score equal: the whole batch is constant
    adv, _ = ADVANTAGES.get(name)(x)
    assert torch.count_nonzero(adv) == 0, adv.abs().max()


def test_gae_whitens_a_constant_batch_to_zero():
    x = _constant(1 / 3, 8)
    x.token_rewards[:8, 2] = 1 / 3
    x.values = torch.zeros_like(x.token_rewards)
    x.token_rewards[:, :2] = 0
    x.gamma = x.lam = 1.0
    x.token_rewards[:, 2] = 1 / 3
    # every valid token's raw advantage is 1/3 (the return from that token on, values 0)
    adv, ret = ADVANTAGES.get("gae")(x)
    assert torch.count_nonzero(adv) == 0
    assert torch.allclose(ret[:, :3], torch.full((24, 3), 1 / 3))


def test_group_spread_by_hand():
    from rlloom.runtime.stages.generation import group_spread
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.7, 0.7, 0.7, 0.7])
    spread = group_spread(scores, torch.tensor([5, 5, 5, 5, 2, 2, 2, 2]))
    # group 5: mean .5, unbiased var 4 * .25 / 3 = 1/3; group 2: constant
    assert spread["reward_std"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert spread["frac_zero_std_groups"] == 0.5


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp", "reinforce_pp_baseline"])
def test_normalised_advantages_do_not_depend_on_the_reward_scale_in_float32(name):
    """A weight of 1e20 on a 0/1 reward (`reward.weights={correct: 1e20}`): the squares
    overflowed float32, the std became inf and every advantage 0, so nothing learned."""
    unit = _constant(0.0, 8)
    big = _constant(0.0, 8)
    big.token_rewards = unit.token_rewards * 1e20
    small, large = (ADVANTAGES.get(name)(x)[0] for x in (unit, big))
    assert large.dtype == torch.float32 and torch.count_nonzero(large) > 0
    torch.testing.assert_close(large, small, rtol=1e-5, atol=0)
