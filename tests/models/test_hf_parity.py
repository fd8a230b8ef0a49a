"""rlloom's model against the transformers implementation on tiny random checkpoints."""
import pytest
import torch
import transformers

from rlloom.models.config import UnsupportedArchitectureError
from rlloom.models.hf_io import CheckpointError, load_model

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"attention_bias": True}),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   {"tie_word_embeddings": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 12}),
}


def save_hf(tmp_path, family):
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = cfg_cls(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rope_theta=500.0, **extra)
    torch.manual_seed(0)
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():  # biases and norms are zeros/ones at init: randomise to test them
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    hf = save_hf(tmp_path, family)
    ours = load_model(tmp_path).eval()
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_batch_matches_unpadded_rows(tmp_path, family):
    save_hf(tmp_path, family)
    model = load_model(tmp_path).eval()
    a = torch.tensor([[5, 6, 7, 8, 9]])
    b = torch.tensor([[11, 12, 13]])
    batch = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with torch.no_grad():
        both = model(batch, mask)
        assert (both[0] - model(a)[0]).abs().max() < 1e-5
        assert (both[1, 2:] - model(b)[0]).abs().max() < 1e-5


def test_unsupported_architecture_lists_supported(tmp_path):
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                     num_attention_heads=2, vocab_size=50)
    transformers.GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(tmp_path)
    assert "unsupported architecture ['GPTNeoXForCausalLM']" in str(e.value)
    assert all(arch in str(e.value) for arch in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel", "GptOssForCausalLM",
        "DeepseekV3ForCausalLM"))


def test_missing_model_directory_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere.*does not exist"):
        load_model(tmp_path / "nowhere")


def test_saved_checkpoint_round_trips_and_loads_in_transformers(tmp_path):
    from rlloom.models.hf_io import load_tokenizer, save_checkpoint
    from rlloom.models.tokenizer import build_char_tokenizer

    save_hf(tmp_path / "src", "qwen3")
    ours = load_model(tmp_path / "src").eval()
    save_checkpoint(ours, build_char_tokenizer(), tmp_path / "out")
    again = load_model(tmp_path / "out").eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ours(ids), again(ids))
        assert (hf(input_ids=ids).logits - ours(ids)).abs().max() < 1e-4
    tok = load_tokenizer(tmp_path / "out")
    assert tok.decode(tok("Q:7+5=")["input_ids"]) == "Q:7+5="
    assert not list(tmp_path.glob(".out.*"))   # no temporary directory left behind


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_reward_model_matches_sequence_classification(tmp_path, family):
    from rlloom.models.hf_io import load_value_model

    cfg_cls, _, extra = FAMILIES[family]
    cls = {"llama": transformers.LlamaForSequenceClassification,
           "qwen2": transformers.Qwen2ForSequenceClassification,
           "qwen3": transformers.Qwen3ForSequenceClassification}[family]
    cfg = cfg_cls(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                  **extra)
    torch.manual_seed(0)
    hf = cls(cfg).float().eval()
    hf.save_pretrained(tmp_path)
    ours = load_value_model(tmp_path).eval()
    ids = torch.randint(1, 97, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[:, 0]      # score at the last (non-pad) token
        got = ours(ids)[:, -1]
    assert (got - ref).abs().max() < 1e-4


def test_reward_model_with_several_labels_is_refused(tmp_path):
    from rlloom.models.hf_io import load_value_model

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_labels=3,
                                   pad_token_id=0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="3 labels; a reward model has one"):
        load_value_model(tmp_path)


def test_a_bf16_checkpoint_says_so_and_carries_a_generation_config(tmp_path):
    import json

    from rlloom.models.hf_io import save_checkpoint
    save_hf(tmp_path / "src", "llama")
    ours = load_model(tmp_path / "src", torch.bfloat16).eval()
    save_checkpoint(ours, None, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.config.eos_token_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert hf.dtype == torch.bfloat16
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits.float() - ours(ids).float()).abs().max() < 0.05


@pytest.mark.parametrize("change, message", [
    ({"hidden_act": "relu2"}, r"hidden_act='relu2' is not supported; rlloom implements silu, "
                              r"gelu"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
     r"rope_type 'proportional' is not supported"),
])
def test_config_fields_rlloom_does_not_implement_are_refused(tmp_path, change, message):
    import json
    save_hf(tmp_path, "qwen2")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(UnsupportedArchitectureError, match=message):
        load_model(tmp_path)


def test_a_tokenizer_without_a_pad_token_pads_with_eos(tmp_path):
    from rlloom.models.hf_io import load_tokenizer
    from rlloom.models.tokenizer import build_char_tokenizer
    tok = build_char_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == loaded.eos_token_id == 2
