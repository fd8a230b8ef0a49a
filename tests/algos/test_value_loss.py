import pytest
import torch

from rlloom.algos.value import value_loss

D = torch.float64


def test_value_loss_by_hand():
    # clip .2:
    # tok 0: V 1, old .5, R 2: (1-2)^2 = 1; clipped V = .5 + .2 = .7, (.7-2)^2 = 1.69 -> .845,
    #        the clipped term wins and its V is saturated -> grad 0
    # tok 1: V 2, old 2.5, R 0: 4 vs (2.3)^2 = 5.29 -> 2.645, grad 0
    # tok 2: V 0, old 0, R 1: both 1 -> .5, grad (V - R) = -1
    # tok 3: padding -> 0, no grad
    values = torch.tensor([[1.0, 2.0, 0.0, 7.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.5, 2.5, 0.0, -7.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.0, 1.0, float("nan")]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    loss = value_loss(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.845, 2.645, 0.5, 0]], dtype=D))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0, 0, -1, 0]], dtype=D))


def test_unclipped_value_loss_by_hand():
    # 0.5 (V - R)^2 = [.5, 2, .5, pad 0]
    values = torch.tensor([[1.0, 2.0, 0.0, 7.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.0, 1.0, 3.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    loss = value_loss(values, values + 5, returns, mask, clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 2.0, 0.5, 0]], dtype=D))


@pytest.mark.parametrize("clip", [None, 0.2])
def test_clipped_loss_is_never_below_unclipped(clip):
    g = torch.Generator().manual_seed(0)
    v, old, r = (torch.randn(5, 6, generator=g, dtype=D) for _ in range(3))
    mask = torch.ones(5, 6, dtype=D)
    assert (value_loss(v, old, r, mask, clip) >= value_loss(v, old, r, mask, None)).all()
