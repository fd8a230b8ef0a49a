"""The families beyond Llama/Qwen/Mistral (rlloom/models/families: Mixtral, OLMo 2, Phi-3,
Gemma 2, Gemma 3, GPT-2, gpt-oss)
against transformers on random-weight checkpoints it saved: logits of a left-padded batch,
20 greedy tokens through the engine and through the plain cached decode, the export
reloaded in transformers, and a PEFT adapter where the module names allow one. One TP and
one ZeRO-3 layout of each run in tests/parallel/test_parallel_equivalence.py."""
import pytest
import torch
import transformers

from rlloom.models.config import UnsupportedArchitectureError
from rlloom.models.hf_io import load_model, save_adapter, save_checkpoint
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
DEEPSEEK = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, routed_scaling_factor=2.5, num_key_value_heads=4,
                max_position_embeddings=128)
FAMILIES = {
    "mixtral": (transformers.MixtralForCausalLM, dict(num_local_experts=4,
                                                      num_experts_per_tok=2)),
    "mixtral_sliding": (transformers.MixtralForCausalLM, dict(num_local_experts=4,
                                                              num_experts_per_tok=2,
                                                              sliding_window=6)),
    "olmo2": (transformers.Olmo2ForCausalLM, {}),
    "phi3": (transformers.Phi3ForCausalLM, {}),
    "phi3_sliding": (transformers.Phi3ForCausalLM, dict(sliding_window=5)),
    # Phi-3.5's longrope past an original length of 2 (every test sequence is longer: its
    # long factors throughout, as transformers' generate takes them for a prompt past it;
    # the short ones below), Phi-4-mini's rotation of 3/4 of each head
    "phi3_longrope": (transformers.Phi3ForCausalLM, dict(
        original_max_position_embeddings=2, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
    "phi3_partial": (transformers.Phi3ForCausalLM, dict(partial_rotary_factor=0.75)),
    # small caps, so that capping changes the scores and logits; layers alternate a window
    "gemma2": (transformers.Gemma2ForCausalLM, dict(head_dim=16, sliding_window=6,
                                                    query_pre_attn_scalar=20,
                                                    attn_logit_softcapping=3.0,
                                                    final_logit_softcapping=2.0)),
    # its own rotary base on the sliding layers (a small one, so that it matters)
    "gemma3": (transformers.Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    # Gemma 3 4B-27B: linear scaling (factor 8) on the full layers only
    "gemma3_scaled": (transformers.Gemma3ForCausalLM, dict(
        head_dim=16, sliding_window=6, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    # GPT-2's config spells the shared fields its own way (the class maps BASE's names), its
    # MLP is n_inner wide (BASE's intermediate_size is a stray key it ignores, as rlloom must)
    "gpt2": (transformers.GPT2LMHeadModel, dict(n_inner=80)),
    # no rotary embedding on its NoPE layers (every second one here)
    "smollm3": (transformers.SmolLM3ForCausalLM, dict(no_rope_layer_interval=2)),
    # sinks, biased router and experts, clamped SwiGLU, a window on alternate layers, yarn
    # (small experts and a low clamp, so that clamping changes activations)
    "gpt_oss": (transformers.GptOssForCausalLM, dict(
        head_dim=12, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=6, swiglu_limit=0.5, max_position_embeddings=4096)),
    # latent attention with a q bottleneck and interleaved rotary pairs, yarn (its mscale
    # grows the scores' scale), a dense first layer, then sigmoid routing within the best 2
    # of 4 groups, a correction bias (randomised below), scaled weights, a shared expert
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, dict(DEEPSEEK, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    # one q_proj, rotary halves, default rope; a large rms_norm_eps, which the latent's own
    # norm does not take (transformers' is 1e-6 there)
    "deepseek_v3_plain": (transformers.DeepseekV3ForCausalLM, dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, rms_norm_eps=0.1)),
}


def save_family(path, name):
    cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    hf = cls(cls.config_class(**{**BASE, **extra})).float().eval()
    with torch.no_grad():  # norms are ones and biases zeros at init: randomise to test them
        for n, p in hf.named_parameters():
            if "norm" in n or ".ln_" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
        for n, b in hf.named_buffers():  # DeepSeek's routing correction, zeros at init
            if "correction_bias" in n:
                b.add_(torch.randn_like(b) * 0.1)
    hf.save_pretrained(path)
    return hf


def _batch():
    ids = torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_export_and_greedy_decoding_match_transformers(tmp_path, name):
    hf = save_family(tmp_path / "src", name)
    ours = load_model(tmp_path / "src").eval()
    ids, mask = _batch()
    prompts = [[5, 9, 14, 3, 22, 40, 7], [8, 31, 4]]
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    with torch.no_grad():
        assert (ours(ids[:1]) - hf(input_ids=ids[:1]).logits).abs().max() < 1e-5
        # the left-padded row equals itself unpadded
        padded = ours(ids, mask)[1:, 4:] - hf(input_ids=ids[1:, 4:]).logits
        assert padded.abs().max() < 1e-5
        engine = engine_generate(ours, prompts, params, eos_id=-1, pad_id=0)
        cached = generate(ours, prompts, params, -1, 0)
        for row, prompt in enumerate(prompts):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert engine.response_ids[row].tolist() == ref
            assert cached.response_ids[row].tolist() == ref
        save_checkpoint(ours, None, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert (back(input_ids=ids).logits - ours(ids)).abs().max() < 1e-5
        assert torch.equal(load_model(tmp_path / "out")(ids), ours(ids))


@pytest.mark.parametrize("name", ["olmo2", "gemma2", "gemma3"])
def test_peft_loads_the_adapter(tmp_path, name):
    peft = pytest.importorskip("peft")
    from rlloom.models.lora import apply_lora, lora_modules, peft_config
    save_family(tmp_path / "base", name)
    model = load_model(tmp_path / "base").eval()
    targets = ("q_proj", "k_proj", "o_proj", "up_proj")
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=targets, seed=3)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.05)
    save_adapter(model.state_dict(), peft_config(4, 8.0, 0.0, targets, str(tmp_path / "base")),
                 tmp_path / "adapter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, _ = _batch()
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - model(ids)).abs().max() < 1e-5


@pytest.mark.parametrize("name", ["mixtral", "olmo2", "phi3", "gemma2", "gemma3", "gpt2", "gpt_oss",
                                  "smollm3", "deepseek_v3", "deepseek_v3_plain"])
def test_the_cost_model_reads_each_family_as_the_runtime_does(tmp_path, name):
    from rlloom.perf.model.shapes import model_shape
    from rlloom.perf.search.planner import _tp_applies
    save_family(tmp_path, name)
    model, shape = load_model(tmp_path), model_shape(str(tmp_path))
    cfg = model.config
    held = sum(p.numel() for p in model.parameters())
    # the q/k norm vectors counted too: OLMo2's over all heads, Gemma3's per head; GPT-2's
    # biases, LayerNorm biases and position table
    assert shape.params == cfg.num_params == held
    assert (shape.n_experts, shape.moe_ffn) == (cfg.n_experts, cfg.moe_intermediate_size)
    # the planner offers TP where the runtime runs it (not yet DeepSeek's latent attention)
    assert _tp_applies(2, shape) == (not cfg.latent)
    if cfg.latent:  # LoRA's default targets there: o_proj (and a q_proj) and the MLPs
        from rlloom.models.lora import apply_lora
        apply_lora(model, 4, 8.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"), 0)
        lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        assert shape.lora_params(4) == lora
        cache = 3 * (16 + 4) * 2     # layers x (latent + rotary key) x bf16
        assert shape.kv_bytes_per_token() == cache


def test_capped_attention_is_priced_with_its_scores(tmp_path):
    """Gemma2's soft-capped scores run without a fused kernel: a layer keeps its [heads,
    keys] scores per token for backward, SCORE_B bytes each, split over TP's heads."""
    from rlloom.perf.model import memory as mem
    from rlloom.perf.model.shapes import model_shape
    from rlloom.plan import Layout
    save_family(tmp_path / "gemma2", "gemma2")
    save_family(tmp_path / "phi3", "phi3")
    capped, fused = model_shape(str(tmp_path / "gemma2")), model_shape(str(tmp_path / "phi3"))
    one, tp2 = Layout(), Layout(tp=2)
    for layout in (one, tp2):
        grows = (mem.layer_activation_bytes(capped, layout, 4096)
                 - mem.layer_activation_bytes(capped, layout, 0))
        assert grows == mem.SCORE_B * 4 / layout.tp * 4096       # 4 heads
        assert mem.layer_activation_bytes(fused, layout, 4096) == \
            mem.layer_activation_bytes(fused, layout, 0)
        # a generation prefill holds one layer's scores over its prompts at a time
        assert (mem.prefill_bytes_per_token(capped, layout.tp, 512)
                - mem.prefill_bytes_per_token(capped, layout.tp)) == mem.SCORE_B * 4 / layout.tp * 512


def test_gemma3_reads_the_full_layers_scaling_from_an_older_config():
    """Gemma 3 4B's config.json as released: rope_scaling and rope_local_base_freq."""
    from rlloom.models.config import ModelConfig
    cfg = transformers.Gemma3TextConfig(**BASE, head_dim=16).to_dict()
    cfg.pop("rope_parameters")
    cfg.update(architectures=["Gemma3ForCausalLM"], rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    ours = ModelConfig.from_hf(cfg)
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (ours.rope_theta, ours.local_rope_theta, ours.local_rope.rope_scaling) == (1e6, 1e4, {})
    cfg["rope_scaling"] = None
    cfg["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 1e4}}
    with pytest.raises(UnsupportedArchitectureError, match="rope_type 'linear' on its "
                                                           "sliding_attention layers"):
        ModelConfig.from_hf(cfg)


def test_gpt2_past_its_learned_positions_is_refused_before_generating(tmp_path):
    save_family(tmp_path, "gpt2")
    model = load_model(tmp_path).eval()
    assert "learned positions (128)" in model.config.describe()  # what a run prints
    params = SamplingParams(max_new_tokens=120, temperature=0.0)
    for run in (lambda: engine_generate(model, [[5] * 9], params, eos_id=-1, pad_id=0),
                lambda: generate(model, [[5] * 9], params, -1, 0)):
        with pytest.raises(ValueError, match="9 tokens plus 120 new ones exceed the 128 "
                                             "positions this gpt2 model has learned"):
            run()


def test_gpt2_with_layer_scaled_attention_is_refused(tmp_path):
    cfg = transformers.GPT2Config(**BASE, scale_attn_by_inverse_layer_idx=True)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="scale_attn_by_inverse_layer_idx"):
        load_model(tmp_path)


def test_a_quantised_checkpoint_is_refused_with_how_to_dequantise(tmp_path):
    import json
    save_family(tmp_path, "gpt_oss")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}   # as the released checkpoints
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"quantised \(mxfp4\).*Mxfp4Config\(dequantize=True\)"):
        load_model(tmp_path)


def test_phi3_longrope_keeps_its_short_factors_up_to_the_original_length(tmp_path):
    """An original length of 16: a 10-token pass rotates by the short factors, a 21-token
    one by the long, both as transformers does."""
    cls, extra = FAMILIES["phi3_longrope"]
    torch.manual_seed(0)
    hf = cls(cls.config_class(**{**BASE, **extra, "original_max_position_embeddings": 16}))
    hf.float().eval().save_pretrained(tmp_path)
    ours = load_model(tmp_path).eval()
    ids, _ = _batch()
    with torch.no_grad():
        for n in (10, 21):
            assert (ours(ids[:1, :n]) - hf(input_ids=ids[:1, :n]).logits).abs().max() < 1e-5
        # the factors matter: the first 10 tokens' logits change once the pass is longer
        assert (ours(ids[:1, :10]) - ours(ids[:1])[:, :10]).abs().max() > 1e-4


def _image_text(name):
    """An image-text model whose language model is a family rlloom implements, with a tiny
    vision tower; its config.json keeps only the text model's non-default fields, as the
    released checkpoints' do."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    if name == "gemma3":
        text = transformers.Gemma3TextConfig(**{**BASE, **FAMILIES["gemma3_scaled"][1]})
        return transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config=text, vision_config=transformers.SiglipVisionConfig(**vision),
            mm_tokens_per_image=4, image_token_index=96, boi_token_index=95,
            eoi_token_index=94))
    text = transformers.MistralConfig(**{**BASE, "sliding_window": 6})
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, image_token_index=96,
        vision_config=transformers.PixtralVisionConfig(**vision, head_dim=16)))


@pytest.mark.parametrize("name", ["gemma3", "mistral3"])
def test_an_image_text_checkpoint_trains_as_its_language_model(tmp_path, name):
    """Gemma 3 4B-27B and Mistral Small 3.x as released (`*ForConditionalGeneration`): the
    language model loads from text_config and the language_model weights, the vision tower
    is left out, text logits equal transformers' own model's, and the export is the
    text-only causal LM."""
    import json
    torch.manual_seed(0)
    hf = _image_text(name).float().eval()
    hf.save_pretrained(tmp_path / "src")
    path = tmp_path / "src" / "config.json"
    cfg = json.loads(path.read_text())
    defaults = type(hf.config.text_config)().to_dict()
    cfg["text_config"] = {k: v for k, v in cfg["text_config"].items()
                          if k == "model_type" or v != defaults.get(k)}
    path.write_text(json.dumps(cfg))
    ours = load_model(tmp_path / "src").eval()
    from rlloom.perf.model.shapes import model_shape
    held = sum(p.numel() for p in ours.parameters())
    assert held < sum(p.numel() for p in hf.parameters())
    assert model_shape(str(tmp_path / "src")).params == held  # `rlloom plan --model` prices it
    ids, _ = _batch()
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max() < 1e-5
        save_checkpoint(ours, None, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert type(back).__name__ == {"gemma3": "Gemma3ForCausalLM",
                                       "mistral3": "MistralForCausalLM"}[name]
        assert (back(input_ids=ids).logits - ours(ids)).abs().max() < 1e-5


def test_the_released_gpt2_names_load(tmp_path):
    """openai-community/gpt2 stores GPT2Model's names (`h.0.attn.c_attn.weight`, no
    `transformer.` prefix), which transformers loads into GPT2LMHeadModel."""
    from safetensors.torch import load_file, save_file
    hf = save_family(tmp_path, "gpt2")
    path = tmp_path / "model.safetensors"
    save_file({k.removeprefix("transformer."): v.contiguous()
               for k, v in load_file(path).items()}, path)
    ours = load_model(tmp_path).eval()
    ids, _ = _batch()
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max() < 1e-5


def test_gemma3_4b_as_released_reads_as_its_language_model():
    """Gemma 3 4B's config.json as released: text_config lists only what differs from
    transformers' defaults; the head is tied, generation stops at <end_of_turn> (106) too."""
    from rlloom.models.config import ModelConfig
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "eos_token_id": [1, 106], "vision_config": {"model_type": "siglip_vision_model"},
          "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                          "model_type": "gemma3_text", "num_hidden_layers": 34,
                          "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}}
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.tie_word_embeddings, cfg.eos_token_id, cfg.vocab_size) == (True, [1, 106],
                                                                         262208)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 4, 256)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert len(cfg.sliding_layers) == 29 and cfg.sliding_window == 1024   # 5 of 6 layers
    assert round(cfg.num_params / 1e6) == 3880   # the language model of "4B"
    with pytest.raises(UnsupportedArchitectureError, match="quantised"):
        ModelConfig.from_hf({**hf, "quantization_config": {"quant_method": "bitsandbytes"}})
