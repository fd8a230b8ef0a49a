"""Offloaded ZeRO-3 (`Layout.offload`) and the AdamW update priced as the runtime runs them:
shards in host memory, each gather's copy in and each gradient's copy out over the host link,
the update streaming host memory; on a CPU, where the device is the host, nothing moves."""
from dataclasses import replace

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import price
from rlloom.perf.model.hardware import GB, hardware
from rlloom.perf.model.model_state import offload_copy_s, optimizer_s
from rlloom.perf.model.shapes import MODELS
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import search
from rlloom.plan import Layout, Plan

Q7 = MODELS["qwen2.5-7b"]
L70 = MODELS["llama-3-70b"]
ZERO3, OFFLOADED = Layout(dp=8, zero=3), Layout(dp=8, zero=3, offload=True)


def test_offloaded_state_moves_to_host_memory():
    p = Q7.params
    assert mem.model_state_bytes(Q7, ZERO3, True) == pytest.approx(16 * p / 8)
    assert mem.model_state_bytes(Q7, OFFLOADED, True, offloaded=True) == 0
    assert mem.host_state_bytes(Q7, OFFLOADED, True) == pytest.approx(16 * p / 8)
    assert mem.host_state_bytes(Q7, OFFLOADED, False) == pytest.approx(2 * p / 8)
    assert mem.host_state_bytes(Q7, ZERO3, True) == 0


def test_update_and_copies_by_hand():
    hw = hardware("h100")  # HBM 3.35 TB/s, host memory 75 GB/s, PCIe 50 GB/s, mem_eff 0.8
    shard = Q7.params / 8
    assert optimizer_s(Q7, ZERO3, hw) == pytest.approx(28 * shard / (3.35e12 * 0.8))
    assert optimizer_s(Q7, OFFLOADED, hw) == pytest.approx(28 * shard / (75 * GB * 0.8))
    assert optimizer_s(Q7, Layout(dp=8, zero=0), hw) == pytest.approx(
        8 * optimizer_s(Q7, ZERO3, hw))  # unsharded: every device steps every weight
    # per micro-batch: fp32 shard in for forward and for backward, fp32 gradient shard out
    assert offload_copy_s(Q7, OFFLOADED, hw, 3, trained=True) == pytest.approx(
        3 * (4 + 4 + 4) * shard / (50 * GB))
    assert offload_copy_s(Q7, OFFLOADED, hw, 3, trained=False) == pytest.approx(
        3 * 2 * shard / (50 * GB))
    assert offload_copy_s(Q7, ZERO3, hw, 3, trained=True) == 0


def test_training_pays_the_copies_and_the_host_update():
    """With no overlap (dp_overlap 0) the offloaded step is the ZeRO-3 step plus the copies and
    the update's move from HBM to host memory, per optimizer step."""
    hw = replace(hardware("h100"), dp_overlap=0.0)
    wl = Workload(64, 8, 256, Lengths("fixed", 512), minibatches=2)
    plain = cost.training(Q7, ZERO3, wl, hw, "actor")
    off = cost.training(Q7, OFFLOADED, wl, hw, "actor")
    _, m = wl.teacher_forced(-(-wl.rollouts // 8 // 2))  # micro-batches per mini-batch
    extra = 2 * (offload_copy_s(Q7, OFFLOADED, hw, m, trained=True)
                 + optimizer_s(Q7, OFFLOADED, hw) - optimizer_s(Q7, ZERO3, hw))
    assert off.seconds - plain.seconds == pytest.approx(extra, rel=1e-9)
    assert extra > 0


def test_on_a_cpu_offloading_moves_nothing():
    hw = replace(hardware("h100"), host_link_bw=0.0)  # the device is the host
    wl = Workload(8, 4, 64, Lengths("fixed", 64))
    assert cost.training(Q7, OFFLOADED, wl, hw, "actor").seconds == \
        cost.training(Q7, ZERO3, wl, hw, "actor").seconds
    plan = Plan(layouts={"actor": OFFLOADED})
    models = {"actor": Q7, "reference": Q7}
    assert price(plan, models, wl, hw).mem_gib == \
        price(Plan(layouts={"actor": ZERO3}), models, wl, hw).mem_gib


def test_offload_makes_a_70b_fit_on_8_gpus_and_host_memory_bounds_it():
    wl = Workload(32, 8, 512, Lengths("lognormal", 512, 2048))
    hw = hardware("h100")
    assert not search(L70, "grpo", wl, hw, 8).ranked  # 16 B x 70 B / 8 = 140 GB a device
    best = search(L70, "grpo", wl, hw, 8, offload=True).ranked[0]
    assert best.plan.layouts["actor"].offload
    assert best.mem_gib["all"] < hw.mem_gib * mem.USABLE
    small_host = replace(hw, host_mem_gib=64)  # below the 140 GB of fp32 state per device
    found = search(L70, "grpo", wl, small_host, 8, offload=True)
    assert not any(p.plan.layouts["actor"].offload for p in found.ranked)
    plan = Plan(layouts={"actor": OFFLOADED})
    problems = price(plan, {"actor": L70, "reference": L70}, wl, small_host).problems
    assert any("offloaded model state needs" in p and "the host has 64" in p for p in problems)


def test_plan_writes_an_offloaded_layout_the_config_loads(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    main(["plan", "--model", "llama-3-70b", "--gpus", "8xH100", "--prompts", "32",
          "--p50", "512", "--p99", "2048", "--offload", "--write-plan", str(out)])
    assert "-offload" in capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.plan.layouts["actor"].offload and cfg.plan.layouts["actor"].zero == 3
