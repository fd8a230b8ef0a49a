import math

import pytest
import torch

from rlloom.algos.preference import PREFERENCE_LOSSES, preference_accuracy

D = torch.float64


def test_dpo_and_ipo_by_hand():
    # pair 0: h = (-1 - -1.5) - (-2 - -1.5) = .5 + .5 = 1
    # pair 1: h = (-3 - -2) - (-1 - -1) = -1
    # beta .1: dpo = -log sigmoid(.1 h) = log(1 + exp(-.1 h)); ipo = (h - 1/(2*.1))^2 = (h - 5)^2
    pc = torch.tensor([-1.0, -3.0], dtype=D, requires_grad=True)
    pr, rc, rr = (torch.tensor(v, dtype=D) for v in ([-2.0, -1.0], [-1.5, -2.0], [-1.5, -1.0]))
    dpo = PREFERENCE_LOSSES.get("dpo")(pc, pr, rc, rr, 0.1)
    torch.testing.assert_close(dpo.detach(), torch.tensor([math.log1p(math.exp(-0.1)),
                                                           math.log1p(math.exp(0.1))], dtype=D))
    dpo.sum().backward()
    # d/d pc of -log sigmoid(beta h) = -beta sigmoid(-beta h)
    sig = [1 / (1 + math.exp(0.1)), 1 / (1 + math.exp(-0.1))]
    torch.testing.assert_close(pc.grad, torch.tensor([-0.1 * sig[0], -0.1 * sig[1]], dtype=D))
    ipo = PREFERENCE_LOSSES.get("ipo")(pc.detach(), pr, rc, rr, 0.1)
    torch.testing.assert_close(ipo, torch.tensor([16.0, 36.0], dtype=D))
    assert preference_accuracy(pc.detach(), pr, rc, rr).item() == 0.5


def test_ipo_refuses_non_positive_beta():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="beta"):
        PREFERENCE_LOSSES.get("ipo")(x, x, x, x, 0.0)
