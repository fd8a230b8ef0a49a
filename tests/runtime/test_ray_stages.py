"""The Ray runtime's stage helpers against the single-process functions (no Ray needed)."""
from dataclasses import replace

import pytest
import torch

from rlloom.algos.policy_losses import POLICY_LOSSES, PolicyLossConfig
from rlloom.config import load_config
from rlloom.data.synthetic import generate
from rlloom.models.heads import ValueModel
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.models.transformer import CausalLM
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.rollout.generate import Rollout
from rlloom.runtime.default_model import tiny_model_config
from rlloom.runtime.executor.corrections import Rows, decoupled
from rlloom.runtime.stages.generation import Rewarder, Samples, sample_groups
from rlloom.runtime.stages.online import assess, assess_from, logprobs_of, scores
from rlloom.runtime.stages.packing import trim
from tests.conftest import TINY


def _setup(*overrides):
    cfg = load_config(None, [*TINY, "rollout.max_new_tokens=12", *overrides])
    tok = build_char_tokenizer()
    policy = CausalLM(tiny_model_config(cfg.model, len(tok)))
    policy.init_weights(seed=0)
    critic = ValueModel.from_policy(policy)
    torch.nn.init.normal_(critic.score.weight, std=0.5, generator=torch.Generator().manual_seed(1))
    return cfg, tok, policy, critic


def _chunks(cfg, tok, policy, n_chunks):
    """Scored chunks of groups with spread-out rewards (so advantages are not all zero)."""
    rewarder = Rewarder(cfg, tok, None, None)
    gen = torch.Generator().manual_seed(0)
    problems = generate("arith", 6, seed=3, difficulty=1)
    parts = [sample_groups(policy, tok, problems[i::n_chunks], cfg, rewarder, gen)
             for i in range(n_chunks)]
    return [replace(s, scores=torch.rand(len(s.scores), generator=gen)) for s in parts]


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce_pp"])
def test_fused_assessment_equals_assess_on_the_merged_batch(algo):
    cfg, tok, policy, critic = _setup(f"algo={algo}", "algo.kl_coef=0.05")
    reference = CausalLM(policy.config)
    reference.init_weights(seed=5)
    parts = _chunks(cfg, tok, policy, 3)
    whole = Samples.cat(parts, tok.pad_token_id)
    assert whole.group_ids.tolist() == [g for g in range(6) for _ in range(4)]
    uses_critic = critic if algo == "ppo" else None
    expected = assess(whole, reference, uses_critic, 0.05, None, cfg)
    width = whole.rollout.response_ids.shape[1]
    outs = [scores(s, reference, uses_critic, cfg) for s in parts]   # per chunk

    def pad(x):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))
    ref = torch.cat([pad(r) for r, _ in outs])
    values = torch.cat([pad(v) for _, v in outs]) if uses_critic else None
    got = assess_from(whole, ref, values, 0.05, None, cfg)
    mask = whole.rollout.response_mask.bool()
    for name in ("advantages", "returns", "ref_logp", "old_values", "loss_mask"):
        a, b = getattr(expected, name), getattr(got, name)
        if a is None:
            assert b is None
            continue
        # chunks pad prompts to another width, so forwards agree to float rounding only
        assert torch.allclose(a[mask], b[mask], atol=1e-5), name
    assert expected.advantages.abs().sum() > 0


def test_decoupled_correction_equals_decoupled_ppo():
    g = torch.Generator().manual_seed(0)
    n, t = 6, 9
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    old = -torch.rand(n, t, generator=g) * 2          # behaviour log-probs
    prox = old + 0.3 * torch.randn(n, t, generator=g)  # proximal (weights before the update)
    adv = torch.randn(n, t, generator=g)
    for cfg in (PolicyLossConfig(), PolicyLossConfig(dual_clip=3.0)):
        logp_a = (prox + 0.4 * torch.randn(n, t, generator=g)).requires_grad_()
        logp_b = logp_a.detach().clone().requires_grad_()
        want, clip_a = POLICY_LOSSES.get("decoupled_ppo")(logp_a, old, adv, mask, cfg, prox)
        weight = (prox - old).exp()
        got, clip_b = POLICY_LOSSES.get("ppo")(logp_b, prox, adv * weight, mask, cfg)
        assert torch.allclose(want, got, atol=1e-6) and torch.equal(clip_a, clip_b)
        want.sum().backward()
        got.sum().backward()
        assert torch.allclose(logp_a.grad, logp_b.grad, atol=1e-6)


def test_decoupled_uses_current_weights_as_proximal_policy():
    cfg, tok, policy, _ = _setup()
    samples = Samples.cat(_chunks(cfg, tok, policy, 1), tok.pad_token_id)
    exp = assess(samples, None, None, 0.0, None, cfg)
    fixed, kl = decoupled(exp, policy, cfg.rollout.temperature, Rows(64))
    # the samples came from these very weights: proximal == behaviour up to float rounding
    mask = samples.rollout.response_mask.bool()
    assert abs(kl) < 1e-4
    assert torch.allclose(fixed.samples.rollout.logprobs[mask], samples.rollout.logprobs[mask],
                          atol=1e-4)
    assert torch.allclose(fixed.advantages, exp.advantages, atol=1e-4)


def test_the_proximal_forward_runs_the_tokens_the_cost_model_prices():
    """A stale step's proximal log-probs: 7 short responses and one long one run in length
    buckets, the padded tokens `Workload.teacher_forced` prices (101 here), not as mini-batches
    padded to the batch's longest row (360 tokens, which made long-tailed async steps train
    2-3x slower than priced), and give the log-probs of a forward over each row alone."""
    cfg, _, policy, _ = _setup()
    lengths = [3] * 7 + [40]
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(40)[None] < torch.tensor(lengths)[:, None]).long()
    rollout = Rollout(torch.randint(5, 30, (8, 5), generator=g), torch.ones(8, 5, dtype=torch.long),
                      torch.randint(5, 30, (8, 40), generator=g) * mask, mask,
                      torch.full((8, 40), -1.0) * mask, torch.ones(8, dtype=torch.bool))
    scores_ = torch.rand(8, generator=g)
    samples = Samples([None, None], rollout, torch.arange(8) // 4, {}, scores_)
    exp = assess(samples, None, None, 0.0, None, cfg)
    seen = []
    # the backbone: log-probs run it and then the head on response positions only
    hook = policy.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].numel()))
    fixed, _ = decoupled(exp, policy, 1.0, Rows(budget=64))
    hook.remove()
    priced, passes = Workload(prompts=2, samples=4, prompt_len=5,
                              response=Lengths.empirical(lengths),
                              micro_batch_tokens=64).teacher_forced(8)
    assert (sum(seen), len(seen)) == (priced, passes) == (101, 2)
    for i in (0, 7):  # one row at a time, unpadded
        row = rollout.select(torch.tensor([i]))
        alone = logprobs_of(policy, trim(row), 1.0)
        assert torch.allclose(fixed.samples.rollout.logprobs[i, :lengths[i]], alone[0], atol=1e-5)
