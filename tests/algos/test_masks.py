import statistics

import torch

from rlloom.algos.masks import last_token, masked_whiten


def test_last_token_by_hand():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.float32)
    expected = [[False, True, False], [False, False, False], [False, False, True],
                [False, False, True]]
    assert last_token(mask).tolist() == expected


def test_masked_whiten_uses_the_population_variance():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    mean, var = 2.5, statistics.pvariance([1, 2, 3, 4])
    expected = [[(v - mean) / (var + 1e-8) ** 0.5 for v in r] + [0.0] for r in ([1, 2], [3, 4])]
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor(expected, dtype=torch.float64))
