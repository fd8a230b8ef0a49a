"""rlloom's Qwen3-MoE against transformers' Qwen3MoeForCausalLM on tiny random checkpoints."""
import pytest
import torch
import transformers
from safetensors.torch import save_file

from rlloom.models.hf_io import load_model, save_checkpoint
from rlloom.models.moe import MoEBlock
from rlloom.models.transformer import MLP

# (norm_topk_prob, decoder_sparse_step, mlp_only_layers): both router normalisations and both
# ways Qwen3-MoE keeps a layer dense.
VARIANTS = {"norm_step1_dense1": (True, 1, [1]), "raw_step2": (False, 2, [])}


def save_hf(path, variant):
    norm, step, dense = VARIANTS[variant]
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm, decoder_sparse_step=step,
        mlp_only_layers=dense, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=500.0)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms are ones at init: randomise to test them
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def ids(seed, shape=(3, 17)):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_moe_logits_match_transformers(tmp_path, variant):
    hf = save_hf(tmp_path, variant)
    ours = load_model(tmp_path).eval()
    _, step, dense = VARIANTS[variant]
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    assert kinds == [MLP if i in dense or (i + 1) % step else MoEBlock for i in range(3)]
    x = ids(1)
    with torch.no_grad():
        assert (ours(x) - hf(input_ids=x).logits).abs().max().item() < 1e-4


def test_fused_expert_tensors_load(tmp_path):
    """transformers 5 keeps experts fused in memory; a state dict saved as is must load too."""
    hf = save_hf(tmp_path / "src", "norm_step1_dense1")
    fused = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in fused.items()},
              str(tmp_path / "fused" / "model.safetensors"))
    a, b = load_model(tmp_path / "src").eval(), load_model(tmp_path / "fused").eval()
    x = ids(3)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


def test_saved_moe_checkpoint_reloads_in_transformers(tmp_path):
    save_hf(tmp_path / "src", "norm_step1_dense1")
    ours = load_model(tmp_path / "src").eval()
    save_checkpoint(ours, None, tmp_path / "out")
    again = load_model(tmp_path / "out").eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert again.config == ours.config
    x = ids(2, (2, 9))
    with torch.no_grad():
        assert torch.equal(ours(x), again(x))
        assert (hf(input_ids=x).logits - ours(x)).abs().max() < 1e-4


def test_moe_gradients_reach_router_and_chosen_experts():
    from rlloom.models.config import ModelConfig
    from rlloom.models.transformer import CausalLM

    cfg = ModelConfig(family="qwen3_moe", vocab_size=50, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True,
                      n_experts=4, experts_per_token=2, moe_intermediate_size=8)
    model = CausalLM(cfg)
    model.init_weights(0, std=0.2)
    model(ids(5, (2, 6)) % 50).logsumexp(-1).sum().backward()
    block = model.model.layers[0].mlp
    assert block.gate.weight.grad.abs().sum() > 0
    assert sum(bool(e.up_proj.weight.grad.any()) for e in block.experts) >= 2


def test_experts_need_the_moe_family():
    from rlloom.models.config import ModelConfig, UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError,
                       match=r"needs an MoE family \(qwen3_moe, mixtral, gpt_oss, "
                             r"deepseek_v3\), not 'qwen3'"):
        ModelConfig(family="qwen3", vocab_size=50, hidden_size=16, intermediate_size=32,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, n_experts=4,
                    experts_per_token=2, moe_intermediate_size=8)
