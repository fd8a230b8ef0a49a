"""The driver's round trip per stage call (`Hardware.call_s`): priced once per rank of each
group a step calls, placed by the simulator's timeline the same way, and measured by
`rlloom perf calibrate` from the gaps a run's trace.json shows between its stages."""
import json
from dataclasses import replace

import pytest

from rlloom.algos.presets import PRESETS
from rlloom.perf.model.compose import price, role_models
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.validation.simulate import timeline
from rlloom.perf.validation.validate import call_gaps
from rlloom.plan import Layout, Plan

SHAPE, HW = model_shape("qwen2.5-0.5b"), hardware("h100")
MODELS = role_models(SHAPE, PRESETS["grpo"].roles)  # actor and reference
WL = Workload(64, 8, 512, Lengths("fixed", 1024))
CALL = 0.01


def _plans() -> dict[str, Plan]:
    colocated = Plan(layouts={"actor": Layout(dp=4), "reference": Layout(dp=4)})
    apart = Plan(placement="disaggregated", layouts={
        "actor": Layout(dp=4), "reference": Layout(dp=2), "generation": Layout(dp=2)})
    return {"colocated": colocated, "disaggregated sync": apart,
            "disaggregated async": apart.model_copy(update={"schedule": "async",
                                                             "staleness": 1})}


@pytest.mark.parametrize("name, calls", [
    # generation, assessment, training: one call to each of the 4 ranks of "all"
    ("colocated", 3 * 4),
    # generation (2 ranks), assessment (reference's 2), training (actor's 4), and the
    # weight sync to the generation group's 2
    ("disaggregated sync", 2 + 2 + 4 + 2)])
def test_a_sync_step_pays_one_round_trip_per_rank_of_each_stage_call(name, calls):
    plan = _plans()[name]
    without = price(plan, MODELS, WL, HW)
    with_calls = price(plan, MODELS, WL, replace(HW, call_s=CALL))
    assert with_calls.step_s - without.step_s == pytest.approx(calls * CALL, rel=1e-9)
    assert with_calls.train_s == without.train_s  # a stage's own time leaves it out


def test_an_async_step_pays_the_calls_of_its_slower_chain():
    """Generation-bound: the step is generation's chain, which pays the generation call (2
    ranks) and the reference's assessment beside it (2); the trainer's calls overlap it."""
    plan = _plans()["disaggregated async"]
    without = price(plan, MODELS, WL, HW)
    assert without.gen_s > without.train_s  # generation-bound
    with_calls = price(plan, MODELS, WL, replace(HW, call_s=CALL))
    assert with_calls.step_s - without.step_s == pytest.approx((2 + 2) * CALL, rel=1e-9)


@pytest.mark.parametrize("name", ["colocated", "disaggregated sync"])
def test_the_timeline_places_the_calls_as_the_price_counts_them(name):
    """Fixed lengths: the timeline's steady-state interval equals the priced step, calls
    included. (Async is left out: its price adds assessment to generation's chain, where the
    timeline runs it beside the next step's generation.)"""
    plan, hw = _plans()[name], replace(HW, call_s=CALL)
    sim = timeline(plan, MODELS, [WL] * 6, hw)
    assert sim.step_s == pytest.approx(price(plan, MODELS, WL, hw).step_s, rel=1e-9)


def test_call_gaps_are_the_gaps_in_front_of_each_stage_per_rank(tmp_path):
    """Step 2 on a group of 2 ranks: generation ends at 1.00 s, assessment starts at 1.01 s,
    training at 1.13 s after assessment's end at 1.10 s; step 2's generation starts 0.02 s
    after step 1's training, step 3's 0.02 s after the eval span (what it waited for, not a
    stage). Gaps 0.02, 0.01, 0.03, 0.02 s over 2 ranks; step 1 is the warm-up."""
    def span(name, step, start, end):
        return {"name": name, "ph": "X", "pid": "all", "tid": name, "ts": start * 1e6,
                "dur": (end - start) * 1e6, "args": {"step": step}}
    events = [span("generation", 1, 0.0, 0.5), span("training", 1, 0.6, 0.9),
              span("generation", 2, 0.92, 1.0), span("assessment", 2, 1.01, 1.1),
              span("training", 2, 1.13, 1.5), span("eval", 2, 1.5, 1.7),
              span("generation", 3, 1.72, 1.8)]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    gaps = call_gaps(tmp_path, {"all": 2}, skip=1)
    assert gaps == pytest.approx([0.01, 0.005, 0.015, 0.01])
    assert call_gaps(tmp_path / "none", {"all": 2}) == []
