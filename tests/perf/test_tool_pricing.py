"""Multi-turn rollouts priced as the engine runs them: a conversation keeps its KV slot across
turns, parked while its tool runs and extended by the result (no re-prefill); the replica
waits idle only when every held slot is waiting on a tool. The schedule is checked against
the engine's own decode steps, prefills and extends on a real multi-turn run."""
from dataclasses import replace

import pytest
import torch

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.perf.model import cost, engine_schedule
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import MODELS
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.multi_turn import Dialogue, Tools
from rlloom.rollout.sampling import SamplingParams
from rlloom.rollout.tools import CALL_END, ToolRunner

SHAPE, X, HW = MODELS["qwen2.5-7b"], Layout(dp=8), hardware("h100")
WL = Workload(64, 8, 512, Lengths("lognormal", 600, 4000))
KV = 40e9
K = 4


def test_schedule_by_hand():
    """Two rollouts on two slots: A = turns of 3 and 2 tokens with a 4-token result and a
    call of 2 steps; B = 2 tokens. Step 0: both admitted (one prefill), a token each. Step 1:
    B ends; A holds 2 tokens. Step 2: A's first turn ends (3 tokens) and parks. Steps 2-4:
    nothing live, idle. Step 4: A extends 1 + 4 tokens (the extend's logits give its next
    turn's first token: 3 + 4 + 1 = 8 past the prompt) and its 2-token turn takes 1 step."""
    s = engine_schedule.engine_schedule([], 2, 1, turns=[[(3, 4, 2), (2, 0, 0)], [(2, 0, 0)]])
    assert s.segments == ((1, 2, 2, 1), (1, 1, 2, 2), (1, 1, 8, 8))
    assert s.prefills == (2,) and s.extends == (5,) and s.idle_steps == 2


@pytest.mark.parametrize("slots", [2, 7, 24])
def test_the_schedule_is_what_the_engine_runs_with_tools(slots, engine_counts):
    """A random model whose token 5 reads as a call's end: every turn with a 5 in it is a
    (malformed) call whose error result comes back at once, so the engine's decode steps,
    live rows, prefills and extends are exact, and equal the schedule priced from the turns
    the rollouts took."""
    cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    model = CausalLM(cfg)
    model.init_weights(seed=3, std=0.3)
    seen = engine_counts

    def decode_text(ids):
        return "".join(CALL_END if t == 5 else "x" for t in ids)

    def encode(text):
        return [9] * (len(text) // 10)
    prompts = [p for p in [[5, 6, 7], [11, 12], [13, 14, 15, 16], [3, 4], [17], [20, 21]]
               for _ in range(K)]
    dialogue = Dialogue(Tools(ToolRunner({}, 1.0, 100), 3, "tag"), len(prompts), 30,
                        decode_text, encode)
    out = engine_generate(model.eval(), prompts, SamplingParams(
        30, temperature=1.0, stop=(CALL_END,)), 7, 0, torch.Generator().manual_seed(1),
        EngineConfig(max_batch=slots, n_samples=K), decode_text, dialogue)
    turns = []
    for ids, mask, inj in zip(out.response_ids.tolist(), out.response_mask.tolist(),
                              out.injected.tolist()):
        plan, sampled, result = [], 0, 0
        for keep, injected in zip(mask, inj):
            if not keep:
                break
            if injected:
                result += 1
            elif result:
                plan.append((sampled, result, 0))
                sampled, result = 1, 0
            else:
                sampled += 1
        turns.append(plan + [(sampled, 0, 0)])
    assert sum(len(t) > 1 for t in turns) >= 6, "the test needs conversations with calls"
    priced = engine_schedule.engine_schedule([], slots, K, turns=turns)
    assert seen["steps"] == priced.decode_steps
    assert seen["live"] == priced.rollout_steps
    assert seen["prefills"] == len(priced.prefills)
    assert seen["extends"] == list(priced.extends)
    assert priced.idle_steps == 0


def test_turns_extend_instead_of_prefilling_the_history_again():
    """Instant tools: three turns decode the same tokens less the two that extends give,
    and pay two extend forwards per rollout; with a result of 32 tokens inside the same
    response, fewer tokens are decoded and the step is cheaper."""
    one = cost.generation(SHAPE, X, WL, HW, KV)
    three = cost.generation(SHAPE, X, replace(WL, turns=3), HW, KV)
    assert "128 extend forwards; 0 s idle" in three.note
    assert "3997 decode steps" in three.note and "3999 decode steps" in one.note
    assert one.seconds < three.seconds < 1.1 * one.seconds
    results = cost.generation(SHAPE, X, replace(WL, turns=3, tool_result_len=32), HW, KV)
    assert results.seconds < three.seconds


def test_a_lone_rollout_waits_out_each_call_and_others_hide_it():
    """One rollout per replica: nothing else decodes while its tool runs, so it waits
    (turns - 1) latencies, to within one step each. 64 rollouts: their waits overlap with
    each other's decoding, and the idle time is far below the calls' latency summed."""
    lone = replace(WL, prompts=8, samples=1, response=Lengths("fixed", 600))
    base = cost.generation(SHAPE, X, replace(lone, turns=3), HW, KV)
    slow = cost.generation(SHAPE, X, replace(lone, turns=3,
                                             tool_latency=Lengths("fixed", 2.0)), HW, KV)
    step = base.seconds / 597
    assert 4.0 <= slow.wait_s < 4.0 + 2 * step
    assert slow.seconds == pytest.approx(base.seconds + slow.wait_s, rel=1e-6)
    many = cost.generation(SHAPE, X, replace(WL, turns=3,
                                             tool_latency=Lengths("lognormal", 0.5, 5.0)),
                           HW, KV)
    calls = 64 * 2
    assert 0 <= many.wait_s < 0.05 * calls * Lengths("lognormal", 0.5, 5.0).mean
