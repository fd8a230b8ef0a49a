"""LoRA adapters on rlloom's decoder: exact at initialisation, gradients as autograd gives them
through the merged weights W + (alpha / r) B A, the base model with adapters off, the engine's
fused weights, and an export that `peft` loads onto the transformers model."""
import json

import pytest
import torch
import transformers

from rlloom.models.hf_io import load_model, save_adapter
from rlloom.models.lora import (
    LoRALinear,
    adapters_disabled,
    apply_lora,
    lora_modules,
    merged_state,
    peft_config,
)
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams

TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")


def _hf(path):
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)


def _adapted(path, dtype=torch.float32, trained=True):
    model = load_model(path, dtype).eval()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=TARGETS, seed=3)
    if trained:  # B = 0 at initialisation: give it values, as training would
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for m in lora_modules(model).values():
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
    return model


def _ids():
    return torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))


def test_only_adapters_train_and_zero_b_is_exactly_the_base(tmp_path):
    _hf(tmp_path)
    base = load_model(tmp_path).eval()
    model = _adapted(tmp_path, trained=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{k}" for n in lora_modules(model) for k in ("lora_A", "lora_B")}
    assert len(lora_modules(model)) == 2 * len(TARGETS)
    with torch.no_grad():
        assert torch.equal(model(_ids()), base(_ids()))


def test_adapter_gradients_equal_autograd_through_the_merged_weights(tmp_path):
    _hf(tmp_path)
    model = _adapted(tmp_path, torch.float64)
    ids = _ids()
    loss = model(ids).logsumexp(-1).mean()
    loss.backward()
    # the same function with each adapted weight written as W + (alpha / r) B A
    leaves = {n: (m.lora_A.detach().clone().requires_grad_(),
                  m.lora_B.detach().clone().requires_grad_()) for n, m in
              lora_modules(model).items()}
    plain = load_model(tmp_path, torch.float64).eval()
    weights = dict(plain.named_parameters())
    merged = {f"{n}.weight": weights[f"{n}.weight"] + (b @ a) * 2.0
              for n, (a, b) in leaves.items()}
    ref = torch.func.functional_call(plain, merged, (ids,)).logsumexp(-1).mean()
    ref.backward()
    for n, m in lora_modules(model).items():
        a, b = leaves[n]
        torch.testing.assert_close(m.lora_A.grad, a.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(m.lora_B.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_adapters_disabled_is_the_base_model(tmp_path):
    _hf(tmp_path)
    base, model = load_model(tmp_path).eval(), _adapted(tmp_path)
    with torch.no_grad():
        assert not torch.equal(model(_ids()), base(_ids()))
        with adapters_disabled(model):
            assert torch.equal(model(_ids()), base(_ids()))
        assert all(m.enabled for m in lora_modules(model).values())


def test_the_engine_decodes_with_the_adapters(tmp_path):
    _hf(tmp_path)
    model = _adapted(tmp_path)
    prompts = [[5, 9, 14, 3], [8, 31]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    with torch.no_grad():
        fused = engine_generate(model, prompts, params, eos_id=-1, pad_id=0)
        plain = generate(model, prompts, params, -1, 0)
        with adapters_disabled(model):
            base = engine_generate(model, prompts, params, eos_id=-1, pad_id=0)
    assert torch.equal(fused.response_ids, plain.response_ids)
    assert not torch.equal(fused.response_ids, base.response_ids)


def test_peft_loads_the_exported_adapter_and_the_merged_weights_agree(tmp_path):
    peft = pytest.importorskip("peft")
    _hf(tmp_path / "base")
    model = _adapted(tmp_path / "base")
    state = model.state_dict()
    save_adapter(state, peft_config(4, 8.0, 0.0, TARGETS, str(tmp_path / "base")),
                 tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == sorted(TARGETS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    merged = load_model(tmp_path / "base").eval()
    merged.load_state_dict(merged_state(model, state))
    with torch.no_grad():
        ours = model(_ids())
        assert (hf(input_ids=_ids()).logits - ours).abs().max() < 1e-5
        assert (merged(_ids()) - ours).abs().max() < 1e-5


def test_targets_that_match_nothing_are_refused(tmp_path):
    _hf(tmp_path)
    with pytest.raises(ValueError, match=r"model.lora.targets \['qproj'\] match no linear "
                                         r"layer; the decoder's are q_proj"):
        apply_lora(load_model(tmp_path), 4, 8.0, 0.0, ("qproj",), 0)
    assert not any(isinstance(m, LoRALinear) for m in load_model(tmp_path).modules())
