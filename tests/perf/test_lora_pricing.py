"""LoRA priced as the runtime runs it: adapters counted by hand, frozen base weights plus fully
trained adapters in memory, backward without weight gradients, adapter-only weight sync, the
reference as the actor itself, and a planner that ranks only the layouts LoRA runs on."""
from dataclasses import replace

import pytest

from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import price
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import MODELS, ModelShape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import search
from rlloom.plan import Layout, Plan

# L=2, d=8, 2 query heads and 1 kv head of 4, d_ff=16, SwiGLU
SMALL = ModelShape("small", 2, 8, 16, 2, 1, 4, 50)


def test_adapter_count_by_hand():
    # per layer: q, o: r (8 + 8) each; k, v: r (8 + 4) each; gate, up, down: r (8 + 16) each
    # = r (32 + 24 + 72) = 128 r; 2 layers at r = 2: 512
    assert SMALL.lora_params(2) == 512


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_is_frozen_base_plus_trained_adapters(zero):
    x = Layout(dp=4, zero=zero)
    # the frozen base stays in the trained model's fp32: twice a frozen model's bf16, sharded
    # at ZeRO-2 too (FSDP shards every parameter of the trained model; a frozen model is
    # wrapped at ZeRO-3 only; rehearsed in tests/perf/test_rehearsal.py)
    frozen = 2 * mem.model_state_bytes(SMALL, Layout(dp=4, zero=max(zero, 3 * (zero == 2))),
                                       trainable=False)
    adapters = mem.model_state_bytes(ModelShape("a", 1, 1, 1, 1, 1, 1, 1), x, True) \
        / ModelShape("a", 1, 1, 1, 1, 1, 1, 1).params * 512  # 16 B per adapter, ZeRO-sharded
    assert mem.model_state_bytes(SMALL, x, True, lora_rank=2) == pytest.approx(
        frozen + adapters)


def test_backward_skips_the_frozen_weight_gradients():
    wl = Workload(8, 4, 64, Lengths("fixed", 64))
    shape, x, hw = MODELS["qwen2.5-7b"], Layout(dp=8, zero=3), hardware("h100")
    full = cost.training(shape, x, wl, hw, "actor")
    lora = cost.training(shape, x, replace(wl, lora_rank=16), hw, "actor")
    # per rank 4 rows of 64 + 64 tokens, the head at the 64 response positions: LoRA saves
    # one forward's worth of the layers' matmuls and of the head (attention's backward is
    # the same without weight gradients)
    saved = 4 * 128 * shape.layer_matmul_flops() + 4 * 64 * shape.head_flops
    assert full.flops - lora.flops == pytest.approx(8 * saved)
    critic = cost.training(shape, x, replace(wl, lora_rank=16), hw, "critic")
    assert critic.flops == full.flops  # the critic trains every weight


def test_weight_sync_ships_adapters_and_the_reference_is_the_actor():
    shape, hw = MODELS["qwen2.5-7b"], hardware("h100")
    wl = Workload(64, 8, 512, Lengths("fixed", 1024))
    lora = replace(wl, lora_rank=16)
    models = {"actor": shape, "reference": shape}
    apart = Plan(placement="disaggregated", reference="with_actor",
                 layouts={"actor": Layout(dp=4, zero=3), "reference": Layout(dp=4, zero=3),
                          "generation": Layout(dp=4)})
    full_sync = price(apart, models, wl, hw).sync_s
    lora_sync = price(apart, models, lora, hw).sync_s
    # the broadcast (and the copy back to the device) ships the adapters alone; rank 0
    # gathers the whole model either way (`RankGroup.full_state`, then `trained_state`)
    shipped = 2 * (shape.params - shape.lora_params(16))
    assert full_sync - lora_sync == pytest.approx(
        shipped / (hw.inter_node_bw * hw.comm_eff) + shipped / hw.host_link_bw)
    together = Plan(layouts={"actor": Layout(dp=8, zero=3), "reference": Layout(dp=8, zero=3)})
    full_mem, lora_mem = (price(together, models, w, hw).mem_gib["all"] for w in (wl, lora))
    reference = mem.model_state_bytes(shape, Layout(dp=8, zero=3), False) / 2 ** 30
    assert full_mem - lora_mem > reference  # no reference copy, and no full optimizer state


def test_the_planner_ranks_only_layouts_lora_runs_on():
    wl = Workload(64, 8, 512, Lengths("lognormal", 512, 2048), lora_rank=16)
    found = search(MODELS["qwen2.5-7b"], "grpo", wl, hardware("h100"), 8)
    assert found.ranked
    for p in found.ranked:
        for x in [*p.plan.layouts.values(), *([p.gen_layout] if p.gen_layout else [])]:
            assert x.tp == x.pp == x.ep == 1
    assert any("model.lora" in why for _, why in found.rejected)
