"""Properties the composed model must have, and the planner on 64 H100s."""
import pytest

from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import price, role_models
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import MODELS
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import describe, naive, search
from rlloom.plan import Layout, Plan

Q7 = MODELS["qwen2.5-7b"]
H100 = hardware("h100")
LONG = Workload(512, 8, 512, Lengths("lognormal", 2048, 16384), micro_batch=1)
MODELS_GRPO = role_models(Q7, ("actor", "reference", "reward"))


def test_dp_shortens_until_communication_dominates():
    wl = Workload(64, 8, 512, Lengths("fixed", 512))
    times = [cost.training(Q7, Layout(dp=dp, zero=1), wl, H100, "actor").seconds
             for dp in (1, 2, 4, 8, 16, 64, 512, 4096)]
    assert times[0] > times[1] > times[2] > times[3]
    assert times[-1] > min(times)  # at 4096 replicas the gradient all-reduce dominates


def test_tp_lowers_memory_per_device():
    sizes = [mem.model_state_bytes(Q7, Layout(tp=tp), True)
             + mem.activation_bytes(Q7, Layout(tp=tp), 4096, True) for tp in (1, 2, 4, 8)]
    assert sizes == sorted(sizes, reverse=True)


def _disagg(schedule: str, eta: int = 0) -> Plan:
    return Plan(placement="disaggregated", schedule=schedule, staleness=eta,
                layouts={"actor": Layout(dp=16, zero=2, activation_checkpointing=True),
                         "reference": Layout(dp=16)})


def test_async_never_slower_than_sync_on_same_devices():
    gen = Layout(dp=32)
    sync = price(_disagg("sync"), MODELS_GRPO, LONG, H100, gen)
    asyn = price(_disagg("async", 1), MODELS_GRPO, LONG, H100, gen)
    assert sync.feasible and asyn.feasible and sync.devices == asyn.devices == 64
    assert asyn.step_s <= sync.step_s


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_disaggregated_sync_never_beats_colocated_sync(algo):
    res = search(Q7, algo, LONG, H100, 64)
    colocated = min(p.step_s for p in res.ranked if p.plan.placement == "colocated")
    disagg = [p for p in res.ranked if p.plan.placement == "disaggregated"
              and p.plan.schedule == "sync"]
    assert disagg and all(p.step_s >= colocated for p in disagg)


def test_infeasible_named_and_never_ranked():
    small = hardware("a100-40gb")
    p = price(Plan(layouts={"actor": Layout(dp=8), "reference": Layout(dp=8)}), MODELS_GRPO,
              LONG, small)
    assert not p.feasible and "actor training needs" in p.problems[1]
    res = search(Q7, "grpo", LONG, small, 16)
    assert all(q.feasible for q in res.ranked)


def test_planner_fast_and_beats_naive():
    res = search(Q7, "grpo", LONG, H100, 64)
    base = naive(Q7, "grpo", LONG, H100, 64)
    best = res.ranked[0]
    ratio = base.step_s / best.step_s
    print(f"\nplanner: {res.seconds:.2f} s, {len(res.ranked)} ranked, {len(res.rejected)} "
          f"rejected; naive {base.step_s:.1f} s, best {best.step_s:.1f} s ({ratio:.2f}x): "
          f"{describe(best.plan, best.gen_layout, best.micro_batch)}")
    assert res.seconds < 10
    assert all(p.devices == 64 for p in res.ranked)
    assert ratio >= 1.15
