import math

import torch

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES


def test_grpo_advantage_by_hand():
    # group 0 rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)
    adv = ADVANTAGES.get("grpo")(rewards, groups, mask)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv[0], torch.tensor([expected, expected, 0.0]))
    assert torch.allclose(adv[1], torch.tensor([-expected, -expected, 0.0]))
    assert torch.equal(adv[4:], torch.zeros(2, 3))      # identical rewards: no signal


def test_ppo_clip_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, clipped = POLICY_LOSSES.get("ppo")(logp, old, adv, 0.2, 0.3)
    # ratio 1.5, A>0: clipped at 1.3; ratio 0.5, A<0: clipped at 0.8 -> -(0.8 * -1)
    assert torch.allclose(loss, torch.tensor([-1.3, 0.8, -1.1, -0.7]), atol=1e-6)
    assert clipped.tolist() == [True, True, False, False]


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert torch.allclose(KL_ESTIMATORS.get("k1")(logp, ref), torch.tensor([math.log(2)]))
    k2 = KL_ESTIMATORS.get("k2")(logp, ref)
    assert torch.allclose(k2, torch.tensor([0.5 * math.log(2) ** 2]))
    # k3 = r - log r - 1 with r = ref/pi = 0.5
    assert torch.allclose(KL_ESTIMATORS.get("k3")(logp, ref), torch.tensor([0.5 + math.log(2) - 1]))


def test_token_mean_split_into_micro_batches_gives_same_gradient():
    w = torch.tensor([0.3, -0.2], requires_grad=True)
    x = torch.randn(6, 5, 2, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(6, 5)
    mask[0, 3:] = 0
    mask[4, 1:] = 0
    agg = AGGREGATIONS.get("token-mean")
    agg(x @ w, mask, mask.sum()).backward()
    whole = w.grad.clone()
    w.grad = None
    for idx in (slice(0, 2), slice(2, 6)):
        agg(x[idx] @ w, mask[idx], mask.sum()).backward()
    assert torch.allclose(w.grad, whole, atol=1e-6)
