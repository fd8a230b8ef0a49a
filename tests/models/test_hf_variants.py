"""Checkpoint settings real models use, each against transformers: gate activations, rope
scaling (llama3, linear, dynamic, yarn), sliding-window attention (Qwen2, Mistral); for each,
logits of a left-padded batch, greedy decoding through the engine, and an export that loads
back in transformers with the original config fields."""
import json

import pytest
import torch
import transformers

from rlloom.models.hf_io import load_model, save_checkpoint
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rope_theta=500.0)
LONG = 21  # positions in the test batch
VARIANTS = {
    "llama_gelu": ("llama", {"hidden_act": "gelu"}),
    "llama_gelu_tanh": ("llama", {"hidden_act": "gelu_pytorch_tanh"}),
    "llama3_rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # past the trained length (16 < LONG), where dynamic NTK changes the frequencies
    "dynamic_rope": ("llama", {"max_position_embeddings": 16,
                               "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "yarn_rope": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 16}}),
    # layers 1 and 2 attend to the last 5 keys, layer 0 to all
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 5,
                                "max_window_layers": 1}),
    "mistral_sliding": ("mistral", {"sliding_window": 6, "head_dim": 16}),
}
CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}


def save_variant(path, name):
    family, extra = VARIANTS[name]
    cls = CLASSES[family]
    cfg = cls.config_class(**{**BASE, **extra}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = cls(cfg).float().eval()
    with torch.no_grad():  # norms are ones at init: randomise to test them
        for n, p in hf.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def _batch():
    ids = torch.randint(3, 97, (2, LONG), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, name):
    hf = save_variant(tmp_path, name)
    ours = load_model(tmp_path).eval()
    ids, mask = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids[:1]).logits
        assert (ours(ids[:1]) - ref).abs().max().item() < 1e-4
        # the padded row as its own unpadded sequence, in both implementations
        ref = hf(input_ids=ids[1:, 4:]).logits
        got = ours(ids, mask)[1:, 4:]
        assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["qwen2_sliding", "mistral_sliding", "llama_gelu",
                                  "yarn_rope"])
def test_engine_decodes_as_transformers_greedy(tmp_path, name):
    """The engine's decode step (its own attention over the slot cache) and its prefill
    follow the window and the scaled rotary table: 14 greedy tokens after a 7-token prompt
    cross the windows of 5 and 6 keys."""
    hf = save_variant(tmp_path, name)
    ours = load_model(tmp_path).eval()
    prompts = [[5, 9, 14, 3, 22, 40, 7], [8, 31, 4]]
    params = SamplingParams(max_new_tokens=14, temperature=0.0)
    with torch.no_grad():
        got = engine_generate(ours, prompts, params, eos_id=-1, pad_id=0)
        plain = generate(ours, prompts, params, -1, 0)
    for row, prompt in enumerate(prompts):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert got.response_ids[row].tolist() == ref.tolist()
        assert plain.response_ids[row].tolist() == ref.tolist()


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_keeps_the_config_and_loads_in_transformers(tmp_path, name, dtype):
    save_variant(tmp_path / "src", name)
    source = json.loads((tmp_path / "src" / "config.json").read_text())
    ours = load_model(tmp_path / "src", dtype).eval()
    save_checkpoint(ours, None, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    kept = {k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")}
    assert {k: written[k] for k in kept} == kept
    assert written["dtype"] == str(dtype).removeprefix("torch.")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert hf.dtype == dtype
    ids, _ = _batch()
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits.float() - ours(ids).float()).abs().max().item()
    assert diff < (1e-4 if dtype == torch.float32 else 0.05)
