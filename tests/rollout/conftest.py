"""A tiny random model of each supported dense family."""
import pytest

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model(request):
    cfg = ModelConfig(family=request.param, vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      qkv_bias=request.param == "qwen2", qk_norm=request.param == "qwen3")
    m = CausalLM(cfg)
    m.init_weights(seed=3, std=0.3)  # large weights: varied, non-constant greedy outputs
    return m.eval()
