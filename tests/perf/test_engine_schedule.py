"""Generation is priced as the engine runs it: continuous batching over KV slots, prefills at
admission (`perf.engine_schedule`), checked against the engine's own decode steps, and the
long tail kept at any concurrency."""
import math

import pytest
import torch

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.perf.model import cost, engine_schedule
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.sampling import SamplingParams

K = 4
BASE = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16], [3, 4, 5, 6, 7, 8, 9, 10, 11], [17],
        [20, 21, 22]]


def test_engine_schedule_by_hand():
    """Lengths 3, 1, 2, 4 (two prompts of 2 samples) on 2 slots: rollouts 0 and 1 take the
    slots after one prefill; 1 ends on its prefill token, so 2 takes its slot in a second
    prefill round; one step ends 2 and 3 takes its slot (its prompt is prefilled already);
    one more step ends 0; 3 decodes alone for 2 steps. Decode steps make the 10 - 4 tokens
    the prefills did not. The longest live context past the prompt at each segment's start:
    1 (both fresh), 2 (rollout 0), 2 (rollout 3)."""
    s = engine_schedule.engine_schedule([3, 1, 2, 4], slots=2, samples=2)
    assert s.segments == ((1, 2, 2, 1), (1, 2, 3, 2), (2, 1, 2, 2))
    assert s.prefills == (1, 1)
    assert s.decode_steps == 4 and s.rollout_steps == 6


def _sampled_lengths(prompts: list[list[int]], slots: int, seed: int, sample_seed: int
                     ) -> list[int]:
    """Response lengths of a real sampled engine run of a random model (K samples each)."""
    cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    model = CausalLM(cfg)
    model.init_weights(seed=seed, std=0.3)
    out = engine_generate(model.eval(), [p for p in prompts for _ in range(K)],
                          SamplingParams(max_new_tokens=14, temperature=1.0), 7, 0,
                          torch.Generator().manual_seed(sample_seed),
                          EngineConfig(max_batch=slots, n_samples=K))
    lengths = out.response_lengths.tolist()
    assert len(set(lengths)) > 3, "the test needs varied lengths"
    return lengths


@pytest.mark.parametrize("slots", [1, 5, 9, 24])
def test_engine_schedule_is_what_the_engine_runs(slots, engine_counts):
    """The engine's decode steps, live rollouts per step and prefill forwards, counted on a
    real sampled run, equal the schedule priced from its response lengths."""
    lengths = _sampled_lengths(BASE, slots, seed=3, sample_seed=1)
    priced = engine_schedule.engine_schedule(lengths, slots, K)
    assert engine_counts["steps"] == priced.decode_steps
    assert engine_counts["live"] == priced.rollout_steps == sum(lengths) - len(lengths)
    assert engine_counts["prefills"] == len(priced.prefills)
    assert sum(priced.prefills) == len(BASE)


@pytest.mark.parametrize("slots", [3, 24])
def test_keys_read_are_the_widest_live_context(slots, engine_counts):
    """The engine's attention reads every row up to the widest held context: with prompts of
    one length S, its key positions summed over decode steps equal the schedule's segments,
    each step reading S + the longest live context past the prompt."""
    lengths = _sampled_lengths([[5 + p, 6, 7, 8] for p in range(6)], slots, seed=5,
                               sample_seed=2)
    priced = engine_schedule.engine_schedule(lengths, slots, K)
    assert engine_counts["width"] == sum(steps * (4 + widest) + steps * (steps - 1) // 2
                                         for steps, _, _, widest in priced.segments)


def test_the_tail_is_paid_whatever_the_concurrency():
    """A replica of 64 rollouts whose longest is 30x the median: with 8 KV slots it still
    decodes at least as many steps as the longest rollout needs (the old static-wave model
    priced 8-point waves and lost it), and more slots never take more decode steps."""
    wl = Workload(prompts=16, samples=4, prompt_len=16,
                  response=Lengths("lognormal", p50=100, p99=3000))
    longest = max(round(x) for x in wl.response.spread(64))
    steps = []
    for slots in (1, 8, 16, 64):
        s = engine_schedule.engine_schedule(engine_schedule.queue_lengths(wl, 64), slots, 4)
        assert s.decode_steps >= longest - 1
        steps.append(s.decode_steps)
    assert steps == sorted(steps, reverse=True)
    assert steps[-1] == longest - 1  # every rollout at once: the longest sets the step count


def test_the_batch_tail_is_paid_however_many_replicas_share_it():
    """4096 rollouts, lognormal p50 400, p99 3200, cap 32768: the batch's longest is its top
    quantile, 1 - 1/8192: sigma = ln(8) / 2.3263 = 0.8939, z = 3.6683, 400 e^3.2790 = 10,619.6
    tokens, so 10,620 and 10,619 decode steps after the prefill's token. A sync step waits
    for the replica that draws it, so 8 or 64 replicas pay it as one does (priced per
    replica's own share, 64 replicas had paid their 1 - 1/128 quantile: 3,472 tokens)."""
    shape, hw = model_shape("qwen2.5-0.5b"), hardware("h100")
    wl = Workload(prompts=512, samples=8, prompt_len=16,
                  response=Lengths("lognormal", p50=400, p99=3200, cap=32768))
    for dp in (8, 64):
        g = cost.generation(shape, Layout(dp=dp), wl, hw, kv_budget=1e12)
        assert f"{4096 // dp} of {4096 // dp} rollouts per replica at once" in g.note
        assert "10619 decode steps" in g.note


def test_generation_refills_slots_instead_of_waves():
    """Half the rollouts fit: continuous batching costs less than two static waves of the
    same slots (two full tails) and more than all at once."""
    shape, hw = model_shape("qwen2.5-0.5b"), hardware("h100")
    wl = Workload(prompts=64, samples=8, prompt_len=256,
                  response=Lengths("lognormal", p50=500, p99=8000))
    m = cost.mem
    kv_one = m.kv_bytes_per_rollout(shape, Layout(), wl.max_context)

    def budget(slots: int, rollouts: int) -> float:
        """What the engine's slot rule (`memory.generation_slots`) needs for `slots` at once:
        their KV cache and decode logits, a 16384-token prefill and every rollout's outputs."""
        return (m.ROLLOUT_B * rollouts * math.ceil(wl.response.max)
                + 16384 * (m.prefill_bytes_per_token(shape, 1) + shape.kv_bytes_per_token())
                + slots * (kv_one + m.DECODE_B * shape.vocab))
    all_at_once = cost.generation(shape, Layout(), wl, hw, budget(512, 512)).seconds
    half = cost.generation(shape, Layout(), wl, hw, budget(256, 512))
    assert "256 of 512 rollouts per replica at once" in half.note
    assert "255 of 512" in cost.generation(shape, Layout(), wl, hw, budget(256, 512) - 1).note
    waves = 2 * cost.generation(shape, Layout(), Workload(
        prompts=32, samples=8, prompt_len=256, response=wl.response), hw,
        budget(256, 256)).seconds
    assert all_at_once < half.seconds < waves


def test_decode_attention_reads_the_kv_cache_after_the_projections():
    """512 rollouts of 100 tokens at once: the projections are compute-bound at 512 rows, and
    attention's KV read is a kernel of its own, not hidden under them. Halving attn_eff adds
    each decode step's KV read once more, by hand: 99 steps x 512 rows x (256 prompt + 1
    widest + 98/2 mean growth) keys x KV bytes per key / (mem_bw x mem_eff)."""
    from dataclasses import replace
    shape = model_shape("qwen2.5-0.5b")
    hw = replace(hardware("h100"), launch_s=0.0, decode_step_s=0.0)
    wl = Workload(prompts=64, samples=8, prompt_len=256, response=Lengths("fixed", 100))
    budget = 512 * cost.mem.kv_bytes_per_rollout(shape, Layout(), wl.max_context)
    full = cost.generation(shape, Layout(), wl, hw, budget)
    slow = cost.generation(shape, Layout(), wl, replace(hw, attn_eff=0.5), budget)
    kv_read = 99 * 512 * (256 + 1 + 49) * shape.kv_bytes_per_token(2)
    assert slow.seconds - full.seconds == pytest.approx(kv_read / (hw.mem_bw * hw.mem_eff))
    # the projections alone are compute-bound here, so one roofline over both would hide it
    proj_flops = 99 * 512 * shape.decode_flops(0)
    assert proj_flops / (hw.flops("bf16") * hw.compute_eff) > full.memory_s


def test_a_tensor_parallel_replica_is_priced_as_the_plain_loops_waves():
    """rlloom's engine on a tensor-parallel model runs its plain loop (`Engine`, checked in
    tests/parallel/test_parallel_equivalence.py): waves of as many rows as fit, in queue
    order, each prefilled whole (no prefix sharing) and decoded, every row every step, until
    its longest ends."""
    s = engine_schedule.static_schedule((5, 1, 9, 3, 2), 2)
    assert s.segments == ((4, 2, 2, 1), (8, 2, 2, 1), (1, 1, 1, 1))
    assert s.prefills == (2, 2, 1)
    assert (s.decode_steps, s.rollout_steps) == (13, 25)
    shape, hw = model_shape("qwen2.5-7b"), hardware("h100")
    wl = Workload(prompts=64, samples=8, prompt_len=256,
                  response=Lengths("lognormal", p50=500, p99=8000))
    assert "static waves" in cost.generation(shape, Layout(tp=2), wl, hw, 40 * 2**30).note
    assert "continuous batching" in cost.generation(shape, Layout(), wl, hw, 40 * 2**30).note
