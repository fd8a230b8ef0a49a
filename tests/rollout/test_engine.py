"""The generation engine against the reference `generate` and a teacher-forced forward."""
import weakref
from unittest import mock

import pytest
import torch

from rlloom.models.heads import ActorCritic
from rlloom.perf.model.memory import DECODE_B, ROLLOUT_B, prefill_bytes_per_token
from rlloom.perf.model.shapes import ModelShape
from rlloom.rehearsal.memory import PeakMemory
from rlloom.rollout.engine import Engine, EngineConfig, engine_generate
from rlloom.rollout import engine_forward
from rlloom.rollout.engine_forward import prompt_groups
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams, sample, sample_with_uniforms, uniforms
from rlloom.rollout.slot_cache import SlotKVCache, kv_bytes_per_slot, kv_slots
from rlloom.runtime.stages.batch import response_logprobs
from rlloom.runtime.stages.shared_prompt import SharedPrompts

K = 4
BASE = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3, 4, 5, 6, 7, 8, 9, 10, 11], [17],
        [20, 21, 22]]
PROMPTS = [p for p in BASE for _ in range(K)]     # as the trainer passes them: K in a row




def eos_mid_response(model) -> int:
    """A token some greedy responses reach after a few steps: rows end at different times."""
    free = generate(model, BASE, SamplingParams(max_new_tokens=14, temperature=0.0), -1, 0)
    return int(free.response_ids[1, 3])


CONFIGS = {
    "default": EngineConfig(),
    "refill": EngineConfig(max_batch=5),          # fewer slots than the 24 sequences
    "one-slot": EngineConfig(max_batch=1),
    "no-prefix-sharing": EngineConfig(prefix_sharing=False, max_batch=7),
    "static-waves": EngineConfig(continuous=False, max_batch=6),
    "explicit-k": EngineConfig(n_samples=K, max_batch=9),
    "small-prefill": EngineConfig(prefill_tokens=8, max_batch=10),
    "grow-every-step": EngineConfig(kv_chunk=1, max_batch=5),
    "compact": EngineConfig(kv_chunk=3, max_batch=16),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_reference(model, name):
    eos = eos_mid_response(model)
    params = SamplingParams(max_new_tokens=14, temperature=0.0)
    ref = generate(model, PROMPTS, params, eos, 0)
    out = engine_generate(model, PROMPTS, params, eos, 0, config=CONFIGS[name])
    assert len(set(ref.response_lengths.tolist())) > 1, "the test needs rows of varied length"
    for field in ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "finished"]:
        assert torch.equal(getattr(out, field), getattr(ref, field)), field
    assert (out.logprobs - ref.logprobs).abs().max() < 1e-5


def test_sampling_is_reproducible_and_does_not_depend_on_scheduling(model):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=30, min_p=0.01)
    eos = eos_mid_response(model)
    runs = [engine_generate(model, PROMPTS, params, eos, 0, torch.Generator().manual_seed(7),
                            config=c) for c in CONFIGS.values()]
    again = engine_generate(model, PROMPTS, params, eos, 0, torch.Generator().manual_seed(7))
    assert torch.equal(runs[0].response_ids, again.response_ids)
    for r in runs[1:]:
        assert torch.equal(r.response_ids, runs[0].response_ids)
        assert torch.equal(r.finished, runs[0].finished)
    # samples of one prompt differ from each other
    assert len({tuple(x) for x in runs[0].response_ids[:K].tolist()}) > 1
    other = engine_generate(model, PROMPTS, params, eos, 0, torch.Generator().manual_seed(8))
    assert not torch.equal(other.response_ids, runs[0].response_ids)


@pytest.mark.parametrize("temperature, penalty", [(1.0, 1.0), (0.7, 1.0), (0.7, 1.3)])
def test_logprobs_match_teacher_forced_forward(model, temperature, penalty):
    """The recorded log-probs are the policy's, which the trainer recomputes, whatever shapes
    the sampling (top_p, a repetition penalty)."""
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.9,
                            repetition_penalty=penalty)
    out = engine_generate(model, PROMPTS, params, eos_mid_response(model), 0,
                          torch.Generator().manual_seed(1), EngineConfig(max_batch=7))
    rows = torch.arange(len(PROMPTS))
    with torch.no_grad():   # the joined forward, and the trainer's shared prompt pass
        for name, (lp, _, _) in (("joined", response_logprobs(model, out, temperature)),
                                 ("shared prompts", response_logprobs(
                                     model, out, temperature,
                                     prompts=SharedPrompts(model, out, train=False),
                                     rows=rows))):
            diff = ((lp - out.logprobs) * out.response_mask).abs()
            n = out.response_mask.sum()
            print(f"\n{model.config.family} T={temperature}: logprob |engine - {name}| "
                  f"max {diff.max():.2e}, mean {diff.sum() / n:.2e} over {int(n)} tokens")
            assert diff.max() < 1e-4


@pytest.mark.parametrize("name", ["default", "refill", "no-prefix-sharing", "compact"])
def test_a_repetition_penalty_equals_the_reference_and_repeats_less(model, name):
    eos = eos_mid_response(model)
    params = SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=1.8)
    ref = generate(model, PROMPTS, params, eos, 0)
    out = engine_generate(model, PROMPTS, params, eos, 0, config=CONFIGS[name])
    for field in ["response_ids", "response_mask", "finished"]:
        assert torch.equal(getattr(out, field), getattr(ref, field)), field
    plain = engine_generate(model, PROMPTS, SamplingParams(14, temperature=0.0), eos, 0)

    def repeats(r):  # response tokens already in the prompt or earlier in the response
        n = 0
        for p, ids, mask in zip(r.prompt_ids.tolist(), r.response_ids.tolist(),
                                r.response_mask.tolist()):
            held = {t for t in p if t != 0}
            for t, m in zip(ids, mask):
                n += m and t in held
                held.add(t)
        return n

    assert repeats(out) < repeats(plain)


def test_top_k_1_equals_greedy(model):
    greedy = engine_generate(model, PROMPTS, SamplingParams(14, temperature=0.0), 2, 0)
    top1 = engine_generate(model, PROMPTS, SamplingParams(14, temperature=1.0, top_k=1), 2, 0,
                           torch.Generator().manual_seed(3))
    assert torch.equal(top1.response_ids, greedy.response_ids)
    assert torch.allclose(top1.logprobs, greedy.logprobs)


def test_actor_critic_policy(model):
    ac = ActorCritic.from_policy(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    assert torch.equal(engine_generate(ac, PROMPTS, params, 2, 0).response_ids,
                       generate(model, PROMPTS, params, 2, 0).response_ids)


def test_a_model_with_hooks_runs_through_its_own_forward(model):
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda m, args: calls.append(1))
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    out = engine_generate(model, PROMPTS, params, 2, 0)
    assert calls, "a parallel layout's hooks must run"
    assert torch.equal(out.response_ids, generate(model, PROMPTS, params, 2, 0).response_ids)


def test_stop_token_ids_and_stop_strings(model):
    greedy = SamplingParams(max_new_tokens=14, temperature=0.0)
    ref = generate(model, BASE, greedy, -1, 0)
    row = ref.response_ids[0].tolist()
    stop = tuple(row[2:4])
    first = next(i for i in range(len(row) - 1) if tuple(row[i:i + 2]) == stop)
    by_ids = engine_generate(model, BASE, SamplingParams(14, 0.0, stop_token_ids=(stop,)), -1, 0)
    assert by_ids.response_ids[0, :first + 2].tolist() == row[:first + 2]
    assert by_ids.response_lengths[0] == first + 2 and by_ids.finished[0]

    def decode(ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    text = decode(list(stop))
    by_text = Engine(model).generate(BASE, SamplingParams(14, 0.0, stop=(text,)), -1, 0,
                                     decode=decode)
    for i, full in enumerate(ref.response_ids.tolist()):
        s = decode(full)
        n = s.find(text) + len(text) if text in s else len(full)
        assert by_text.response_lengths[i] == n
        assert bool(by_text.finished[i]) == (text in s)
        assert by_text.response_ids[i, :n].tolist() == full[:n]
    with pytest.raises(ValueError, match="decode"):
        engine_generate(model, BASE, SamplingParams(4, stop=("x",)), -1, 0)


def test_eos_and_token_limit_at_the_first_token(model):
    first = generate(model, BASE, SamplingParams(1, 0.0), -1, 0).response_ids[:, 0]
    out = engine_generate(model, BASE, SamplingParams(6, 0.0), int(first[0]), 0,
                          config=EngineConfig(max_batch=2))
    assert out.response_lengths[0] == 1 and out.finished[0]
    one = engine_generate(model, PROMPTS, SamplingParams(1, 0.0), -1, 0,
                          config=EngineConfig(max_batch=3))
    assert torch.equal(one.response_ids[::K, 0], first) and not one.finished.any()


def test_kv_budget_sets_the_slot_count(model):
    prompt = max(map(len, PROMPTS))
    per_slot = kv_bytes_per_slot(model, prompt + 10)
    shape = ModelShape.from_hf_config(model.config.to_hf())
    # three slots' KV cache and decode logits, one prefill of the 16384-token budget, and
    # every sequence's outputs
    reserve = (16384 // prompt) * prompt * (prefill_bytes_per_token(shape, 1)
                                            + shape.kv_bytes_per_token()) \
        + ROLLOUT_B * len(PROMPTS) * 10
    budget = int(reserve + 3 * (per_slot + DECODE_B * shape.vocab)) + 1
    assert kv_slots(model, len(PROMPTS), prompt, prompt + 10, 0, budget, False) == 3
    assert kv_slots(model, len(PROMPTS), prompt, prompt + 10, 0, budget - 2, False) == 2
    eng = EngineConfig(kv_budget_bytes=budget)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert torch.equal(engine_generate(model, PROMPTS, params, 2, 0, config=eng).response_ids,
                       generate(model, PROMPTS, params, 2, 0).response_ids)
    with pytest.raises(ValueError, match="one sequence of 19 positions needs .* GiB"):
        engine_generate(model, PROMPTS, params, 2, 0,
                        config=EngineConfig(kv_budget_bytes=per_slot - 1))


def test_the_engine_stays_within_its_budget(model):
    """bf16 weights and unfused decode projections, as on a GPU: everything generation
    allocates (KV cache, prefill and decode buffers, sampling, outputs) stays within the
    budget it sized its slots for, and the slots use most of it."""
    model = model.to(torch.bfloat16)
    prompt = max(map(len, PROMPTS))
    shape = ModelShape.from_hf_config(model.config.to_hf())
    per_slot = kv_bytes_per_slot(model, prompt + 10)
    reserve = prompt * (prefill_bytes_per_token(shape, 1) + shape.kv_bytes_per_token()) \
        + ROLLOUT_B * len(PROMPTS) * 10
    budget = int(reserve + 5 * (per_slot + DECODE_B * shape.vocab)) + 1
    with PeakMemory() as mem, mock.patch.object(engine_forward, "fuses", lambda w: False):
        engine_generate(model, PROMPTS, SamplingParams(max_new_tokens=10), 2, 0,
                        config=EngineConfig(kv_budget_bytes=budget, prefill_tokens=prompt))
    # beyond the budget only the engine's per-position tables (rotary rows, key positions:
    # about one slot-layer-head's keys and values, 3% of this tiny cache, 0.03% of a 7B
    # model's at 64 slots)
    assert 0.8 * budget < mem.peak <= 1.04 * budget, (mem.peak, budget)


def test_growing_the_kv_cache_holds_one_buffer_twice_not_the_cache(model):
    """A capacity step replaces one layer's keys (or values) at a time: at its peak the new
    cache and one old buffer exist, so a cache sized to `kv_budget_bytes` stays within it
    but one buffer (it held the old and the new cache whole: up to twice the budget)."""
    cache = SlotKVCache(model, slots=4, max_len=64, chunk=16)
    held = [weakref.ref(t) for t in cache.k + cache.v]
    old_bytes, peak, empty = sum(t().nbytes for t in held), [0], torch.empty

    def counted(*args, **kwargs):  # every buffer alive when each new one is made
        out = empty(*args, **kwargs)
        held.append(weakref.ref(out))
        peak[0] = max(peak[0], sum(t().nbytes for t in held if t() is not None))
        return out
    with mock.patch.object(torch, "empty", counted):
        cache.ensure(40)
    old_buffer = old_bytes // (2 * model.config.num_layers)
    assert cache.cap == 48 and sum(t.nbytes for t in cache.k + cache.v) == 3 * old_bytes
    assert peak[0] == 3 * old_bytes + old_buffer  # was 4 x: the old cache beside the new


def test_uniforms_are_uniform_and_keyed_by_seed_sequence_and_step():
    seq = torch.arange(200).repeat_interleave(500)
    step = torch.arange(500).repeat(200)
    u = uniforms(12345, seq, step)
    assert u.min() >= 0 and u.max() < 1 and u.unique().numel() > 0.99 * u.numel()
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45  # 19 degrees of freedom: p ~ 0.001
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]) < 0.01
    assert torch.equal(uniforms(12345, seq[:7], step[:7]), u[:7])
    assert not torch.equal(uniforms(12346, seq, step), u)


def test_prompt_groups():
    assert prompt_groups([[1], [1], [2], [1], [1]]) == [0, 0, 1, 2, 2]
    assert prompt_groups([[1], [1], [1], [1]], n_samples=2) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="differs"):
        prompt_groups([[1], [2]], n_samples=2)
    with pytest.raises(ValueError, match="whole groups"):
        prompt_groups([[1], [1], [1]], n_samples=2)


# -- sampling goldens on a hand-made distribution -----------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None]
N = 4000
GRID = (torch.arange(N, dtype=torch.float64) + 0.5) / N   # evenly spaced uniforms


def freq_at_grid(params):
    tokens, _ = sample_with_uniforms(LOGITS.expand(N, 4), params, GRID)
    return torch.bincount(tokens, minlength=4).double() / N


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), [0.5, 0.3, 0.15, 0.05]),
    # 0.5 + 0.3 >= 0.75: the smallest prefix reaching top_p, renormalised
    (SamplingParams(top_p=0.75), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_p=0.79), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_p=0.4), [1, 0, 0, 0]),                 # the top token always stays
    # min_p = 0.2: keep p >= 0.2 * 0.5 = 0.1
    (SamplingParams(min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    (SamplingParams(min_p=0.5), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_k=3, min_p=0.2), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    # top-k 3 renormalises to [.526, .316, .158]; top_p 0.8 then needs tokens 0 and 1
    (SamplingParams(top_k=3, top_p=0.8), [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    (SamplingParams(top_k=1), [1, 0, 0, 0]),
    (SamplingParams(temperature=0.0, min_p=0.9), [1, 0, 0, 0]),
    # temperature 2 flattens to p ** 0.5, renormalised, before any truncation
    (SamplingParams(temperature=2.0), (PROBS.sqrt() / PROBS.sqrt().sum()).tolist()),
])
def test_truncation_goldens(params, expected):
    # evenly spaced uniforms give the kept, renormalised probabilities to within 1/N
    assert torch.allclose(freq_at_grid(params), torch.tensor(expected, dtype=torch.float64),
                          atol=1.5 / N)


def test_repetition_penalty_golden():
    """Seen tokens' logits divided by the penalty when positive, multiplied when negative
    (1.0 -> 0.5, -1.0 -> -2.0), the unseen one kept; the log-prob stays the policy's."""
    logits = torch.tensor([[1.0, -1.0, 0.5]])
    seen = torch.tensor([[True, True, False]])
    params = SamplingParams(repetition_penalty=2.0)
    expected = torch.tensor([0.5, -2.0, 0.5], dtype=torch.float64).softmax(-1)
    tokens, lp = sample_with_uniforms(logits.expand(N, 3), params, GRID, seen.expand(N, 3))
    freq = torch.bincount(tokens, minlength=3).double() / N
    assert torch.allclose(freq, expected, atol=1.5 / N)
    assert torch.allclose(lp[tokens == 1], logits.log_softmax(-1)[0, 1])
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits.expand(N, 3), params, g, seen.expand(N, 3))
    freq = torch.bincount(tokens, minlength=3).double() / N
    assert torch.allclose(freq, expected, atol=0.03)
    # greedy picks the mode of the penalised logits: token 0 ties with 2, argmax takes 0;
    # at penalty 4 token 0 falls to 0.25 and 2 wins
    greedy = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert sample(logits, greedy, None, seen)[0].tolist() == [2]
    with pytest.raises(ValueError, match="needs the tokens each sequence has seen"):
        sample(logits, params, None)


def test_reference_sampler_applies_min_p_too():
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample(LOGITS.expand(N, 4), SamplingParams(min_p=0.5), g)
    freq = torch.bincount(tokens, minlength=4).double() / N
    assert freq[2] == 0 and freq[3] == 0 and abs(freq[0] - 0.625) < 0.03


def test_logprob_is_of_the_tempered_untruncated_policy():
    _, lp = sample_with_uniforms(LOGITS, SamplingParams(temperature=2.0, top_k=1, min_p=0.5),
                                 torch.tensor([0.3]))
    assert torch.isclose(lp, torch.log_softmax(LOGITS / 2.0, -1)[0, 0])


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]])
    u = torch.tensor([0.0, 0.4999, 0.5, 1.0 - 2.0 ** -24])
    tokens, _ = sample_with_uniforms(logits.expand(4, 4), SamplingParams(), u)
    assert tokens.tolist() == [0, 0, 2, 2]
