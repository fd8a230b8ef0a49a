import math

import pytest
import torch

from rlloom.algos.policy_losses import POLICY_LOSSES, PolicyLossConfig
from rlloom.config import ConfigError, load_config
from rlloom.models.logprobs import entropy_from_logprobs

D = torch.float64


def row(values) -> torch.Tensor:
    return torch.tensor([values], dtype=D)


def loss_and_grad(name, logp, old, adv, mask, cfg, prox=None):
    logp = logp.clone().requires_grad_(True)
    loss, clipped = POLICY_LOSSES.get(name)(logp, old, adv, mask, cfg, prox)
    loss.sum().backward()
    return loss.detach(), clipped, logp.grad


def test_ppo_by_hand():
    # old = 0, so r = exp(logp); clip range [.8, 1.3].
    # r 1.5, A  1: min(1.5, 1.3)   ->  -1.3, clipped, grad 0
    # r 0.5, A -1: min(-.5, -.8)   ->   .8,  clipped, grad 0
    # r 1.1, A  1: inside          ->  -1.1, grad -r A = -1.1
    # r 1.5, A -1: min(-1.5, -1.3) ->  1.5,  unclipped branch, grad -r A = 1.5
    # r 0.5, A  1: min(.5, .8)     ->  -.5,  unclipped branch, grad -.5
    # 6th token is padding: 0, not clipped, no gradient
    ratios = [1.5, 0.5, 1.1, 1.5, 0.5, 1.0]
    logp = row([math.log(r) for r in ratios])
    adv = row([1, -1, 1, -1, 1, 1])
    mask = row([1, 1, 1, 1, 1, 0])
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.3)
    loss, clipped, grad = loss_and_grad("ppo", logp, torch.zeros_like(logp), adv, mask, cfg)
    torch.testing.assert_close(loss, row([-1.3, 0.8, -1.1, 1.5, -0.5, 0]))
    assert clipped.tolist() == [[True, True, False, False, False, False]]
    torch.testing.assert_close(grad, row([0, 0, -1.1, 1.5, -0.5, 0]))


def test_ppo_dual_clip_by_hand():
    # c = 3, clip range [.8, 1.2].
    # r 5, A -1: ppo loss -min(-5, -1.2) = 5 > 3 = -c A -> 3, clipped, grad 0
    # r 2, A -1: ppo loss 2 <= 3 -> 2 (grad -r A = 2)
    # r 5, A  1: dual clip only acts on A < 0 -> -1.2, clipped by the ordinary clip
    logp = row([math.log(5), math.log(2), math.log(5)])
    adv = row([-1, -1, 1])
    cfg = PolicyLossConfig(dual_clip=3.0)
    loss, clipped, grad = loss_and_grad("ppo", logp, torch.zeros_like(logp), adv,
                                        torch.ones_like(logp), cfg)
    torch.testing.assert_close(loss, row([3, 2, -1.2]))
    assert clipped.tolist() == [[True, False, True]]
    torch.testing.assert_close(grad, row([0, 2, 0]))


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_must_exceed_one(c):
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=c)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp, old, adv, mask = random_inputs(0, spread=2.0)
    cfg = PolicyLossConfig(dual_clip=3.0)
    loss, _ = POLICY_LOSSES.get("ppo")(logp, old, adv, mask, cfg)
    plain, _ = POLICY_LOSSES.get("ppo")(logp, old, adv, mask, PolicyLossConfig())
    neg = (adv < 0) & (mask > 0)
    assert (loss[neg] <= -3.0 * adv[neg] + 1e-12).all()
    assert (plain[neg] > -3.0 * adv[neg]).any()  # the bound was actually hit somewhere
    assert torch.equal(loss[~neg], plain[~neg])


def test_gspo_by_hand():
    # clip range [.8, 1.2].
    # Row 0: log-ratios [.1, .2, .3] -> s = exp(.2) = 1.2214 > 1.2; A = 1 -> every token
    #   -1.2, clipped, grad 0.
    # Row 1: log-ratios [0, -.2, pad 10] -> s = exp(-.1) = .904837 (inside); A = -2 ->
    #   loss -s A = 1.809675 on both valid tokens; token t's ratio is sg[s] exp(logp_t -
    #   sg[logp_t]), so each token's grad is -A s = 1.809675 (not s / 2: GSPO-token).
    old = torch.tensor([[-1, -1, -1], [-2, -2, -2]], dtype=D)
    logp = old + torch.tensor([[.1, .2, .3], [0, -.2, 10]], dtype=D)
    adv = torch.tensor([[1, 1, 1], [-2, -2, -2]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    loss, clipped, grad = loss_and_grad("gspo", logp, old, adv, mask, PolicyLossConfig())
    s = math.exp(-0.1)
    torch.testing.assert_close(loss, torch.tensor([[-1.2] * 3, [2 * s, 2 * s, 0]], dtype=D))
    assert clipped.tolist() == [[True] * 3, [False] * 3]
    torch.testing.assert_close(grad, torch.tensor([[0, 0, 0], [2 * s, 2 * s, 0]], dtype=D))


def test_cispo_by_hand():
    # cispo_clip_high 1 -> weight cap 2, no floor. loss = -sg[min(r, 2)] A logp, grad -w A.
    # r 3,  A  1, logp = -1 + log 3  = .098612: w 2  -> -.197225, capped, grad -2
    # r .5, A  1, logp = -2 + log .5 = -2.693147: w .5 -> 1.346574, grad -.5
    # r 1.5,A -2, logp = -.5 + log 1.5 = -.094535: w 1.5 -> -.283605, grad 3
    old = row([-1, -2, -0.5])
    logp = old + row([math.log(3), math.log(0.5), math.log(1.5)])
    adv = row([1, 1, -2])
    cfg = PolicyLossConfig(cispo_clip_high=1.0)
    loss, clipped, grad = loss_and_grad("cispo", logp, old, adv, torch.ones_like(logp), cfg)
    lp = logp[0].tolist()
    torch.testing.assert_close(loss, row([-2 * lp[0], -0.5 * lp[1], 3 * lp[2]]))
    assert loss[0, 1].item() == pytest.approx(1.346574, abs=1e-6)
    assert clipped.tolist() == [[True, False, False]]
    torch.testing.assert_close(grad, row([-2, -0.5, 3]))


def test_cispo_default_cap_is_four():
    assert 1 + PolicyLossConfig().cispo_clip_high == 4.0


def test_every_clip_setting_comes_from_the_config():
    algo = load_config(None, ["algo.clip_low=0.1", "algo.clip_high=0.3", "algo.dual_clip=3",
                              "algo.cispo_clip_high=1"]).algo
    assert PolicyLossConfig.from_algo(algo) == PolicyLossConfig(
        clip_low=0.1, clip_high=0.3, dual_clip=3.0, cispo_clip_high=1.0)


def test_cispo_clip_high_from_config_moves_the_cap():
    # old = 0, so r = exp(logp); loss = -min(r, 1 + cispo_clip_high) A logp.
    # r 2,   A  1: default cap 4 -> w 2   -> -2 log 2   = -1.386294
    #              cap 1.5      -> w 1.5 -> -1.5 log 2 = -1.039721, capped
    # r 1.2, A -1: under both caps, w 1.2 -> 1.2 log 1.2 = .218786
    logp = row([math.log(2), math.log(1.2)])
    old, adv, mask = torch.zeros_like(logp), row([1, -1]), torch.ones_like(logp)
    for overrides, want, capped in [([], [-1.386294, 0.218786], [False, False]),
                                    (["algo.cispo_clip_high=0.5"], [-1.039721, 0.218786],
                                     [True, False])]:
        cfg = PolicyLossConfig.from_algo(load_config(None, ["algo=cispo", *overrides]).algo)
        loss, clipped = POLICY_LOSSES.get("cispo")(logp, old, adv, mask, cfg)
        torch.testing.assert_close(loss, row(want), atol=1e-6, rtol=0)
        assert clipped.tolist() == [capped]
    with pytest.raises(ConfigError, match=r"algo.cispo_clip_high: .*greater than or equal to 0"):
        load_config(None, ["algo.cispo_clip_high=-1"])


def test_decoupled_ppo_by_hand():
    # old (behaviour) = 0, clip range [.8, 1.2], loss = -w min(r A, clip(r) A) with
    # w = exp(prox - old), r = exp(logp - prox).
    # token 0: w 1.25, r 1.5, A  1 -> -1.25 * 1.2 = -1.5, clipped, grad 0
    # token 1: w .8,   r 1.1, A -1 -> -.8 * -1.1 = .88, grad -w r A = .88
    prox = row([math.log(1.25), math.log(0.8)])
    logp = prox + row([math.log(1.5), math.log(1.1)])
    old = torch.zeros_like(logp)
    adv = row([1, -1])
    loss, clipped, grad = loss_and_grad("decoupled_ppo", logp, old, adv, torch.ones_like(logp),
                                        PolicyLossConfig(), prox)
    torch.testing.assert_close(loss, row([-1.5, 0.88]))
    assert clipped.tolist() == [[True, False]]
    torch.testing.assert_close(grad, row([0, 0.88]))
    with pytest.raises(ValueError, match="prox_logp"):
        POLICY_LOSSES.get("decoupled_ppo")(logp, old, adv, torch.ones_like(logp),
                                           PolicyLossConfig())


def test_reinforce_by_hand():
    # -A logp, grad -A; nothing is ever clipped
    logp, adv = row([-0.5, -2.0, -1.0]), row([2, -1, 0.5])
    loss, clipped, grad = loss_and_grad("reinforce", logp, logp.detach(), adv,
                                        torch.ones_like(logp), PolicyLossConfig())
    torch.testing.assert_close(loss, row([1.0, -2.0, 0.5]))
    assert not clipped.any()
    torch.testing.assert_close(grad, row([-2, 1, -0.5]))


def random_inputs(seed: int, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, 9, generator=g, dtype=D) * 3
    logp = old + torch.randn(8, 9, generator=g, dtype=D) * spread
    adv = torch.randn(8, 9, generator=g, dtype=D)
    lengths = torch.randint(0, 10, (8,), generator=g)
    mask = (torch.arange(9) < lengths[:, None]).to(D)
    return logp, old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_decoupled_ppo_equals_ppo_when_prox_is_old(dual_clip):
    logp, old, adv, mask = random_inputs(1, spread=1.0)
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    ppo_loss, ppo_clipped, ppo_grad = loss_and_grad("ppo", logp, old, adv, mask, cfg)
    dec_loss, dec_clipped, dec_grad = loss_and_grad("decoupled_ppo", logp, old, adv, mask, cfg,
                                                    old)
    assert torch.equal(ppo_loss, dec_loss)
    assert torch.equal(ppo_clipped, dec_clipped)
    assert torch.equal(ppo_grad, dec_grad)


@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo"])
def test_no_gradient_where_the_clip_is_active(name):
    # every ratio above 1 + high with A > 0: the clipped branch is a constant
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(4, 5, generator=g, dtype=D)
    logp = old + math.log(1.3) + torch.rand(4, 5, generator=g, dtype=D)
    adv = torch.rand(4, 5, generator=g, dtype=D) + 0.1
    mask = torch.ones_like(old)
    loss, clipped, grad = loss_and_grad(name, logp, old, adv, mask, PolicyLossConfig(), old)
    assert clipped.all()
    assert torch.equal(grad, torch.zeros_like(grad))
    torch.testing.assert_close(loss, -1.2 * adv)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_padding_never_contributes(name):
    logp, old, adv, mask = random_inputs(3)
    prox = old + 0.1
    pad = mask == 0
    assert pad.any()
    cfg = PolicyLossConfig(dual_clip=3.0)
    clean = loss_and_grad(name, logp, old, adv, mask, cfg, prox)

    def poison(x, value):
        return torch.where(pad, torch.tensor(value, dtype=D), x)

    dirty = loss_and_grad(name, poison(logp, 1e4), poison(old, float("-inf")),
                          poison(adv, float("nan")), mask, cfg, poison(prox, -1e4))
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    loss, clipped, grad = clean
    assert not loss[pad].any() and not clipped[pad].any() and not grad[pad].any()


def test_gspo_equals_ppo_on_single_token_sequences():
    # with one token per sequence the sequence ratio is the token ratio
    logp, old, adv, _ = random_inputs(4, spread=0.3)
    mask = torch.zeros_like(logp)
    mask[:, 0] = 1
    cfg = PolicyLossConfig()
    for a, b in zip(loss_and_grad("ppo", logp, old, adv, mask, cfg),
                    loss_and_grad("gspo", logp, old, adv, mask, cfg)):
        torch.testing.assert_close(a, b)


def test_entropy_by_hand():
    # [0, 0] -> log 2; uniform over 4 -> log 4; [0, -inf] -> 0; [1000, 0] -> ~0 (finite)
    logits = torch.tensor([[[0.0, 0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0, 0.0]],
                           [[0.0, -math.inf, -math.inf, -math.inf], [1000.0, 0.0, 0.0, 0.0]]],
                          dtype=D, requires_grad=True)
    h = entropy_from_logprobs(torch.log_softmax(logits, -1))
    torch.testing.assert_close(h, torch.tensor([[math.log(2), math.log(4)], [0.0, 0.0]], dtype=D))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_the_definition():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 11, generator=g, dtype=D) * 3
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logprobs(torch.log_softmax(logits, -1)), -(p * p.log()).sum(-1))
