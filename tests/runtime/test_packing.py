"""Length-bucketed training micro-batches give the mini-batch's gradient (float64)."""
import pytest
import torch

from rlloom.algos.aggregation import AGGREGATIONS, LossNorm
from rlloom.algos.kl import KL_ESTIMATORS
from rlloom.algos.policy_losses import POLICY_LOSSES, PolicyLossConfig
from rlloom.algos.value import value_loss
from rlloom.config import load_config
from rlloom.models.config import ModelConfig
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.transformer import CausalLM
from rlloom.perf.model.buckets import padded_tokens, split_sorted
from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.runtime.ranks import Share
from rlloom.runtime.stages.batch import response_logprobs, response_values
from rlloom.runtime.stages.experience import Experience
from rlloom.runtime.stages.generation import Samples
from rlloom.runtime.stages.online import critic_backward, optimise, policy_backward
from rlloom.runtime.stages.packing import micro_batches, trim
from rlloom.runtime.stages.shared_prompt import SharedPrompts, prompt_chunks

N = 12
CFG = ModelConfig(family="qwen3", vocab_size=30, hidden_size=16, intermediate_size=32,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True)


def experience(policy, seed=0, group=1) -> Experience:
    """N rows; `group` consecutive rows share a prompt, as a GRPO group's samples do."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(2, 10, (N // group,), generator=g).tolist()
    r_lens = torch.randint(1, 14, (N,), generator=g).tolist()
    prompts = [torch.randint(3, 30, (n,), generator=g).tolist() for n in p_lens]
    p_ids, p_mask = left_pad([p for p in prompts for _ in range(group)], 0)
    r_ids, r_mask = right_pad([torch.randint(3, 30, (n,), generator=g).tolist() for n in r_lens],
                              0)
    r = Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(r_ids.shape, dtype=torch.float64),
                torch.ones(N, dtype=torch.bool))
    with torch.no_grad():
        lp, _, _ = response_logprobs(policy, r, 0.8)
    mask = r_mask.double()
    # behaviour log-probs near the policy's, so some tokens clip and some do not
    r.logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)) * mask
    rand = lambda: torch.randn(r_ids.shape, generator=g, dtype=torch.float64) * mask  # noqa: E731
    samples = Samples([], r, torch.arange(N), {}, torch.zeros(N))
    return Experience(samples, mask, lp * mask + 0.1 * rand(), rand(), rand(), rand())


def reference_policy_loss(policy, exp, idx, norm, kl_coef, cfg):
    """The pre-packing computation: one forward over the whole, untrimmed mini-batch."""
    a = cfg.algo
    mb, mask = exp.samples.rollout.select(idx), exp.loss_mask[idx]
    logp, entropy, values = response_logprobs(policy, mb, cfg.rollout.temperature,
                                              with_entropy=True)
    per_token, _ = POLICY_LOSSES.get(a.policy_loss)(
        logp, mb.logprobs, exp.advantages[idx], mask,
        PolicyLossConfig.from_algo(a), prox_logp=mb.logprobs)
    per_token = (per_token + kl_coef * KL_ESTIMATORS.get(a.kl_estimator)(logp, exp.ref_logp[idx])
                 - a.entropy_coef * entropy)
    aggregate = AGGREGATIONS.get(a.loss_agg)
    loss = aggregate(per_token, mask, norm)
    if isinstance(policy, ActorCritic):
        loss = loss + a.vf_coef * aggregate(value_loss(values, exp.old_values[idx],
                                                       exp.returns[idx], mask, a.value_clip),
                                            mask, norm)
    return loss


def grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("extra", [0, 2])
def test_micro_batched_gradient_equals_whole_mini_batch(agg, shared, extra):
    """`extra`: another rank needs that many more micro-batches (torchrun's `agree`)."""
    cfg = load_config(None, ["rollout.temperature=0.8", "algo.entropy_coef=0.01",
                             "algo.kl_coef=0.1", f"algo.loss_agg={agg}"])
    torch.manual_seed(0)
    policy = CausalLM(CFG)
    policy.init_weights(seed=1, std=0.2)
    if shared:
        policy = ActorCritic.from_policy(policy)
        torch.nn.init.normal_(policy.score.weight, std=0.2)
    policy = policy.double()
    exp = experience(policy)
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(2))[:10]
    norm = LossNorm.of(exp.loss_mask[idx], const=cfg.rollout.max_new_tokens)

    reference_policy_loss(policy, exp, idx, norm, 0.1, cfg).backward()
    whole = grads(policy)
    policy.zero_grad(set_to_none=True)
    r = exp.samples.rollout
    def agree(n: int) -> int:
        return n + extra
    parts = micro_batches(r.prompt_mask[idx].sum(1), r.response_mask[idx].sum(1), 60,
                          agree=agree)
    assert len(parts) >= 3 + extra
    stats = policy_backward(policy, exp, idx, norm, 0.1, cfg, micro_batch_tokens=60,
                            agree=agree)
    split = grads(policy)
    diff = max((a - b).abs().max().item() for a, b in zip(whole, split))
    print(f"\n{agg} shared={shared}: {len(parts)} micro-batches, max |grad diff| {diff:.1e}")
    assert len(whole) == len(split) and diff < 1e-6
    with torch.no_grad():
        assert abs(stats["loss"] - reference_policy_loss(policy, exp, idx, norm, 0.1,
                                                         cfg).item()) < 1e-9


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
def test_shared_prompt_pass_gives_the_whole_mini_batch_gradient(agg):
    """Groups of 4 rows share a prompt: one prompt pass per chunk of distinct prompts that
    fits the budget, responses in micro-batches cut by response length, then one backward
    through each prompt pass."""
    cfg = load_config(None, ["rollout.temperature=0.8", "algo.entropy_coef=0.01",
                             "algo.kl_coef=0.1", f"algo.loss_agg={agg}"])
    policy = CausalLM(CFG)
    policy.init_weights(seed=1, std=0.2)
    policy = policy.double()
    exp = experience(policy, group=4)
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(2))[:10]
    norm = LossNorm.of(exp.loss_mask[idx], const=cfg.rollout.max_new_tokens)
    reference_policy_loss(policy, exp, idx, norm, 0.1, cfg).backward()
    whole = grads(policy)
    policy.zero_grad(set_to_none=True)
    r = exp.samples.rollout.select(idx)
    assert SharedPrompts(policy, r, train=False).distinct == len(set((idx // 4).tolist())) < 10
    assert len(prompt_chunks(r, 20)) >= 2           # the prompt pass is split too
    stats = policy_backward(policy, exp, idx, norm, 0.1, cfg, 20, share_prompts=True)
    diff = max((a - b).abs().max().item() for a, b in zip(whole, grads(policy)))
    assert len(whole) == len(grads(policy)) and diff < 1e-6
    with torch.no_grad():
        assert abs(stats["loss"] - reference_policy_loss(policy, exp, idx, norm, 0.1,
                                                         cfg).item()) < 1e-9


def test_separate_critic_gradient():
    cfg = load_config(None, ["algo=ppo"])
    critic = ValueModel(CFG)
    torch.manual_seed(0)
    for p in critic.parameters():
        torch.nn.init.normal_(p, std=0.2)
    critic = critic.double()
    exp = experience(CausalLM(CFG).double())
    idx = torch.arange(N)
    mask = exp.loss_mask
    norm = LossNorm.of(mask)
    aggregate = AGGREGATIONS.get(cfg.algo.loss_agg)
    aggregate(value_loss(response_values(critic, exp.samples.rollout), exp.old_values,
                         exp.returns, mask, cfg.algo.value_clip), mask, norm).backward()
    whole = grads(critic)
    critic.zero_grad(set_to_none=True)
    critic_backward(critic, exp, idx, norm, cfg.algo, micro_batch_tokens=50)
    assert max((a - b).abs().max().item() for a, b in zip(whole, grads(critic))) < 1e-6


def test_micro_batches_cover_rows_once_within_budget():
    g = torch.Generator().manual_seed(0)
    p, r = torch.randint(1, 20, (50,), generator=g), torch.randint(1, 60, (50,), generator=g)
    parts = micro_batches(p, r, 300)
    assert sorted(torch.cat(parts).tolist()) == list(range(50))
    for part in parts:
        cost = len(part) * (p[part].max() + r[part].max())
        assert cost <= 300 or len(part) == 1
    lengths = [(p + r)[part] for part in parts]
    assert all(a.max() <= b.min() for a, b in zip(lengths, lengths[1:]))   # shortest first
    with pytest.raises(ValueError):
        micro_batches(p, r, 0)


def test_an_agreed_count_refines_the_cut_within_budget():
    """Under torchrun every rank runs the ranks' largest micro-batch count: a rank that needs
    fewer halves its largest micro-batches until it has as many."""
    g = torch.Generator().manual_seed(0)
    p, r = torch.randint(1, 20, (50,), generator=g), torch.randint(1, 60, (50,), generator=g)
    base = micro_batches(p, r, 300)
    same = micro_batches(p, r, 300, agree=lambda n: n)
    assert [t.tolist() for t in same] == [t.tolist() for t in base]
    more = micro_batches(p, r, 300, agree=lambda n: n + 3)
    assert len(more) == len(base) + 3
    assert sorted(torch.cat(more).tolist()) == list(range(50))
    for part in more:
        assert len(part) * (p[part].max() + r[part].max()) <= 300 or len(part) == 1
    one = micro_batches(p, r, None, agree=lambda n: 4)  # no budget: one, then halved twice
    assert [len(t) for t in one] == [12, 13, 12, 13]
    with pytest.raises(ValueError, match="51 micro-batches of 50 rows"):
        micro_batches(p, r, 300, agree=lambda n: 51)


def test_split_pays_for_a_long_row_only_when_padding_costs_more_than_a_launch():
    """Four rows of width 2 + 1 and one of 2 + 10: together 5 x 12 = 60 padded tokens, apart
    4 x 3 + 12 = 24 and a second micro-batch's overhead."""
    p, r = [2] * 5, [1, 1, 1, 1, 10]
    assert split_sorted(p, r, 1000, overhead=10) == [(0, 4), (4, 5)]   # 24 + 20 < 60 + 10
    assert split_sorted(p, r, 1000, overhead=50) == [(0, 5)]           # 60 + 50 < 24 + 100
    assert split_sorted(p, r, 59, overhead=50) == [(0, 4), (4, 5)]     # 60 exceeds the budget
    assert padded_tokens(p, r, [(0, 4), (4, 5)]) == 24


def test_split_is_the_cheapest_of_all_contiguous_splits():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        r = sorted(torch.randint(1, 40, (8,), generator=g).tolist())
        p = torch.randint(1, 10, (8,), generator=g).tolist()
        budget, overhead = 150, 16

        def cost(bounds):
            return padded_tokens(p, r, bounds) + overhead * len(bounds)

        def fits(bounds):
            return all(padded_tokens(p, r, [b]) <= budget or b[1] - b[0] == 1 for b in bounds)

        every = []
        for mask in range(2 ** 7):   # a cut after row i when bit i is set
            ends = [i + 1 for i in range(7) if mask >> i & 1] + [8]
            every.append(list(zip([0] + ends[:-1], ends)))
        best = min(cost(b) for b in every if fits(b))
        chosen = split_sorted(p, r, budget, overhead)
        assert fits(chosen) and cost(chosen) == best


def test_trim_drops_only_all_padding_columns():
    ids, mask = left_pad([[5, 6], [7, 8, 9]], 0)
    ids = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], 1)      # extra left padding
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), mask], 1)
    r_ids, r_mask = right_pad([[1], [2, 3]], 0)
    r_ids = torch.cat([r_ids, torch.zeros(2, 4, dtype=torch.long)], 1)   # extra right padding
    r_mask = torch.cat([r_mask, torch.zeros(2, 4, dtype=torch.long)], 1)
    r = Rollout(ids, mask, r_ids, r_mask, torch.zeros(2, 6), torch.ones(2, dtype=bool))
    t = trim(r)
    assert t.prompt_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert t.response_ids.tolist() == [[1, 0], [2, 3]]


def test_no_budget_means_one_micro_batch_in_length_order():
    """Under torchrun every rank must run as many micro-batches: budget None keeps them whole."""
    p, r = torch.tensor([3, 1, 2]), torch.tensor([1, 9, 4])
    [only] = micro_batches(p, r, None)
    assert only.tolist() == [0, 2, 1]


def test_a_replica_whose_rows_are_all_filtered_still_steps_when_others_train():
    """Under data parallelism every rank holds the whole mini-batch and decides to skip on its
    counts, so every rank runs the same passes (a rank skipping alone would leave the others'
    collectives waiting): here replica 1's share is all filtered (overlong) but replica 0's is
    not, so replica 1 runs with zero loss and zero gradient; when no row has a token, all
    skip."""
    cfg = load_config(None, ["algo.epochs=1", "algo.minibatches=1"])
    policy = CausalLM(CFG).double()
    policy.init_weights(seed=1, std=0.2)
    exp = experience(policy)
    n = len(exp.loss_mask)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.1, weight_decay=0.0)
    before = [p.detach().clone() for p in policy.parameters()]
    # the shuffle is a permutation: zero the rows replica 1 gets of it
    order = torch.randperm(n, generator=torch.Generator())
    exp.loss_mask[Share(2, 1).rows(order)] = 0
    stats = optimise(policy, opt, exp, None, None, 0.0, cfg, torch.Generator(), Share(2, 1))
    assert stats["loss"] == 0.0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
    exp.loss_mask.zero_()
    assert optimise(policy, opt, exp, None, None, 0.0, cfg, torch.Generator(),
                    Share(2, 0)) == {}


def test_prompt_chunks_and_response_buckets_hold_the_budget():
    """Distinct prompts of 3, 5 and 8 tokens with a 12-token budget: [3, 5] pad to 2 x 5 = 10,
    adding 8 would make 3 x 8 = 24, so it gets its own chunk. Response micro-batches after a
    shared prompt pass are cut by response length but count the prompt keys they hold."""
    prompts = [[4] * 3, [5] * 5, [6] * 8]
    rows = [prompts[i] for i in (2, 0, 1, 0, 2)]
    p_ids, p_mask = left_pad(rows, 0)
    r_ids, r_mask = right_pad([[7]] * 5, 0)
    r = Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(5, 1), torch.ones(5, dtype=torch.bool))
    assert [c.tolist() for c in prompt_chunks(r, 12)] == [[1, 2, 3], [0, 4]]
    assert [c.tolist() for c in prompt_chunks(r, None)] == [[0, 1, 2, 3, 4]]
    p, resp = torch.tensor([8, 1, 8, 1]), torch.tensor([1, 2, 3, 4])
    parts = micro_batches(p, resp, 20, prompts_done=True)
    # by response length: [0, 1] holds 2 x (8 + 2) = 20; [2, 3] would hold 2 x (8 + 4) = 24
    assert [x.tolist() for x in parts] == [[0, 1], [2], [3]]
    assert all(len(x) * (p[x].max() + resp[x].max()) <= 20 for x in parts)
