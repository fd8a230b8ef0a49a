"""MoE routing replay (`algo.routing_replay=replay`): generation records each token's experts,
training routes the same tokens the same way. With the generator's routing perturbed on
purpose (as other kernels or precision would), the trainer's log-probs equal the sampler's
only with the replay; with nothing perturbed every token agrees."""
import pytest
import torch

import rlloom.models.moe as moe
from rlloom.config import ConfigError, load_config
from rlloom.models.config import ModelConfig
from rlloom.models.logprobs import token_logprobs
from rlloom.models.transformer import CausalLM
from rlloom.perf.model import memory as mem
from rlloom.perf.model.shapes import ModelShape
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.generate import generate
from rlloom.rollout.routes import Agreement
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import joined
from rlloom.runtime.stages.packing import trim
from tests.tiny_run import TINY

PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0)


FAMILIES = {
    "qwen3_moe": dict(qk_norm=True, mlp_only_layers=(0,)),
    # sinks in the decode, a biased router, biased clamped experts on every layer
    "gpt_oss": dict(qkv_bias=True, o_bias=True, attn_sinks=True, router_bias=True,
                    expert_bias=True, swiglu_limit=7.0, norm_topk_prob=True),
    # latent attention (the plain loop decodes it), grouped sigmoid routing, a shared expert
    "deepseek_v3": dict(num_kv_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                        v_head_dim=12, rope_interleave=True, mlp_only_layers=(0,),
                        moe_scoring="sigmoid", n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request):
    base = dict(family=request.param, vocab_size=50, hidden_size=32, intermediate_size=64,
                num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, n_experts=8,
                experts_per_token=2, moe_intermediate_size=16, eos_token_id=2)
    cfg = ModelConfig(**{**base, **FAMILIES[request.param]})
    m = CausalLM(cfg)
    m.init_weights(0, std=0.3)
    return m.double().eval()


GENERATORS = {
    "engine": lambda m: engine_generate(m, PROMPTS, PARAMS, 2, 0,
                                        torch.Generator().manual_seed(1),
                                        EngineConfig(record_routes=True)),
    "plain": lambda m: generate(m, PROMPTS, PARAMS, 2, 0, torch.Generator().manual_seed(1),
                                record_routes=True),
}


def perturbed(monkeypatch):
    """Generation picks its experts from noisy router logits, weighting them by the true
    probabilities: another network's choice, as the replay would face it."""
    real = moe.route

    def route(logits, routing, bias=None, forced=None):
        if forced is None:
            g = torch.Generator().manual_seed(logits.shape[0])
            forced = (logits + torch.randn(logits.shape, generator=g, dtype=logits.dtype)
                      ).topk(routing.k, -1).indices
        return real(logits, routing, bias, forced)
    monkeypatch.setattr(moe, "route", route)


def trainer_logprob_error(model, r, replay: bool) -> tuple[float, float]:
    """Largest |trainer - sampler| log-prob of a response token, and the agreement."""
    agreement = Agreement()
    ids, mask, span = joined(r)
    with torch.no_grad(), agreement.of(model, r.routes if replay else None):
        hidden = model.hidden(ids, mask)[:, span]
    logp, _ = token_logprobs(model.lm_head, hidden, r.response_ids, 1.0)
    return (logp - r.logprobs)[r.response_mask.bool()].abs().max().item(), agreement.value()


@pytest.mark.parametrize("how", sorted(GENERATORS))
def test_replay_restores_the_samplers_log_probs(model, monkeypatch, how):
    with monkeypatch.context() as m:
        perturbed(m)
        r = GENERATORS[how](model)
    with_replay, agreement = trainer_logprob_error(model, r, replay=True)
    without, _ = trainer_logprob_error(model, r, replay=False)
    assert with_replay < 1e-5 < 0.1 < without
    assert 0.2 < agreement < 0.9


def test_the_trainers_recomputed_old_log_probs_replay_too(model, monkeypatch):
    """With the sampler corrected (algo.rollout_is) the trainer's recomputed old log-probs
    replay the routes as well: they equal the sampler's."""
    from rlloom.runtime.executor.corrections import Rows, _trainer_logprobs
    with monkeypatch.context() as m:
        perturbed(m)
        r = GENERATORS["engine"](model)
    with torch.no_grad():
        recomputed = _trainer_logprobs(r, model, 1.0, Rows())
    assert (recomputed - r.logprobs)[r.response_mask.bool()].abs().max() < 1e-5


@pytest.mark.parametrize("how", sorted(GENERATORS))
def test_nothing_perturbed_every_token_agrees(model, how):
    r = GENERATORS[how](model)
    error, agreement = trainer_logprob_error(model, r, replay=True)
    assert error < 1e-5 and agreement == 1.0


def test_the_record_is_in_the_rollouts_joined_layout(model):
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    a = engine_generate(model, PROMPTS, greedy, 2, 0, config=EngineConfig(record_routes=True))
    b = generate(model, PROMPTS, greedy, 2, 0, record_routes=True)
    assert torch.equal(a.response_ids, b.response_ids)
    p = a.prompt_ids.shape[1]
    layers = sum(map(model.config.is_moe_layer, range(model.config.num_layers)))
    assert a.routes.shape == (4, p + a.response_ids.shape[1], layers, 2)   # top 2
    # prompt padding has no route, each real prompt token and fed response token has one
    assert (a.routes[:, :p] >= 0).all(-1).all(-1).tolist() == a.prompt_mask.bool().tolist()
    fed = a.response_mask.clone()
    fed[torch.arange(4), a.response_mask.sum(1) - 1] = 0  # the last token is never fed
    assert torch.equal((a.routes[:, p:] >= 0).all(-1).all(-1), fed.bool())
    # the engine (slots, shared prefills) and the plain loop route every token alike
    both = (a.routes >= 0) & (b.routes >= 0)
    assert both.any() and torch.equal(a.routes[both], b.routes[both])
    # trimming a micro-batch keeps routes aligned with its tokens
    t = trim(a.select(torch.tensor([2, 3])))
    assert t.routes.shape[1] == t.prompt_ids.shape[1] + t.response_ids.shape[1]
    assert torch.equal(t.routes[:, -t.response_ids.shape[1]:],
                       a.routes[2:, p:p + t.response_ids.shape[1]])


def test_a_run_logs_routing_agreement(tmp_path):
    import rlloom
    result = rlloom.train(None, [*TINY, "model.family=qwen3_moe", "train.steps=2",
                                 "algo.routing_replay=replay", f"run_dir={tmp_path / 'run'}"])
    assert [row["routing_agreement"] for row in result.metrics] == [1.0, 1.0]


@pytest.mark.parametrize("overrides, message", [
    (["model.family=qwen3"], "replays the experts an MoE model chose; this policy has none"),
    (["model.family=qwen3_moe", "rollout.engine=vllm"], "vLLM's API does not return"),
])
def test_what_replay_cannot_run_is_refused(overrides, message):
    from rlloom.runtime.executor.preflight import preflight
    cfg = load_config(None, [*overrides, "algo.routing_replay=replay"])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, "process")


def test_the_record_is_priced_where_generation_holds_it():
    shape = ModelShape("moe", 4, 64, 128, 4, 2, 16, 100, n_experts=8, experts_per_token=2,
                       moe_ffn=32)
    args = (shape, 1, 8, 100, 4, False, 64, 200)
    extra = mem.generation_transient_bytes(*args, routes=True) - \
        mem.generation_transient_bytes(*args)
    assert extra == 2 * 64 * (100 + 200) * 4 * 2   # int16 x rollouts x positions x layers x k
