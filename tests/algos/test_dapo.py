import pytest
import torch

from rlloom.algos.dapo import groups_with_signal, overlong_penalty


def test_groups_with_signal_by_hand():
    # group 0 all 1 -> dropped; group 5 has 1 and 0 -> kept; group 2 all .5 -> dropped
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 5, 5, 2, 2])
    assert groups_with_signal(scores, groups).tolist() == [False, False, True, True, False, False]


def test_groups_with_signal_handles_interleaved_groups():
    scores = torch.tensor([0.0, 3.0, 1.0, 3.0])
    groups = torch.tensor([1, 0, 1, 0])
    assert groups_with_signal(scores, groups).tolist() == [True, False, True, False]


def test_overlong_penalty_by_hand():
    # max 20, cache 4 -> soft zone (16, 20]: L 10 -> 0; 16 -> 0; 17 -> (16-17)/4 = -.25;
    # 20 -> -1; 21 -> -1
    lengths = torch.tensor([10, 16, 17, 20, 21])
    out = overlong_penalty(lengths, max_len=20, cache_len=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -1.0, -1.0]))


def test_overlong_penalty_without_soft_zone():
    out = overlong_penalty(torch.tensor([20, 21]), max_len=20, cache_len=0)
    torch.testing.assert_close(out, torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, cache_len=5)
