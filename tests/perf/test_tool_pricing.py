"""Multi-turn rollouts priced as the runtime runs them: each turn an engine call that
prefills the conversation so far again, and between turns the wait for the slowest of a
replica's tool calls."""
from dataclasses import replace

import pytest

from rlloom.perf import cost
from rlloom.perf.hardware import hardware
from rlloom.perf.shapes import MODELS
from rlloom.perf.workload import Lengths, Workload
from rlloom.plan import Layout

SHAPE, X, HW = MODELS["qwen2.5-7b"], Layout(dp=8), hardware("h100")
WL = Workload(64, 8, 512, Lengths("fixed", 1200))
KV = 40e9


def test_turns_decode_the_same_tokens_and_prefill_the_history_again():
    one = cost.generation(SHAPE, X, WL, HW, KV)
    three = cost.generation(SHAPE, X, replace(WL, turns=3), HW, KV)
    assert three.seconds > one.seconds
    # decode FLOPs grow with context, prefill adds the re-read history: more work, not less
    assert three.flops > one.flops
    # a turn of 400 tokens after 800 of history costs what one call at that context costs
    third = cost.generation(SHAPE, X, replace(WL, prompt_len=512 + 800, samples=1,
                                              response=Lengths("fixed", 400)), HW, KV)
    assert three.seconds > third.seconds


def test_each_turn_but_the_last_waits_for_the_slowest_call():
    latency = Lengths("lognormal", 0.5, 5.0)
    base = cost.generation(SHAPE, X, replace(WL, turns=3), HW, KV)
    slow = cost.generation(SHAPE, X, replace(WL, turns=3, tool_latency=latency), HW, KV)
    per_replica = 64 * 8 // 8
    assert slow.seconds - base.seconds == pytest.approx(
        2 * latency.quantile(1 - 1 / (per_replica + 1)))
    assert "2 tool calls per rollout" in slow.note
    assert slow.wait_s == pytest.approx(slow.seconds - base.seconds) and base.wait_s == 0
