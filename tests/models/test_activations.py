"""rlloom's activation functions are transformers' ACT2FN, name for name and value for value
(they are plain torch only to keep transformers' heavy module out of worker start-up)."""
import pytest
import torch
from transformers.activations import ACT2FN

from rlloom.models.activations import ACT_FNS
from rlloom.models.config import ACTIVATIONS


def test_every_supported_activation_has_a_function():
    assert set(ACT_FNS) == set(ACTIVATIONS)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_each_equals_transformers(name):
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(ACT_FNS[name](x), ACT2FN[name](x), rtol=1e-12, atol=1e-12)
