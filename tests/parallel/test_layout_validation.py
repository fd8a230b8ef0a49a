"""Layouts that cannot run are refused before any process group or mesh exists, with the
problem and the fix in the message."""
from __future__ import annotations

import dataclasses

import pytest
from harness import tiny_config, tiny_model

from rlloom.parallel.apply import parallelize
from rlloom.parallel.mesh import MESH_DIMS, LayoutError, layout_problems, validate_layout
from rlloom.plan import Layout

CFG = tiny_config()  # 4 heads, 2 kv heads, intermediate 64, 2 layers


def test_mesh_order_puts_tp_innermost():
    assert MESH_DIMS == ("pp", "dp", "cp", "tp")


@pytest.mark.parametrize("layout, world", [
    (Layout(), 1), (Layout(dp=2, zero=3), 2), (Layout(tp=2), 2),
    (Layout(dp=2, tp=2, zero=1), 4), (Layout(pp=2, dp=2), 4),
])
def test_valid_layouts_pass(layout, world):
    validate_layout(layout, CFG, world)


@pytest.mark.parametrize("layout, world, words", [
    (Layout(dp=2), 4, ["multiply to 2", "world has 4", "pp*dp*cp*tp = 4"]),
    (Layout(tp=4), 4, ["tp=4 does not divide the model's num_kv_heads=2", "use tp in [1, 2]"]),
    (Layout(tp=3), 3, ["num_heads=4", "num_kv_heads=2", "intermediate_size=64"]),
    (Layout(pp=4), 4, ["pp=4 does not divide num_layers=2"]),
    (Layout(dp=2, ep=2), 2, ["no experts", "set ep=1"]),
    (Layout(zero=2), 1, ["zero=2", "dp=1", "set zero=0 or dp>1"]),
])
def test_invalid_layouts_name_problem_and_fix(layout, world, words):
    with pytest.raises(LayoutError) as err:
        validate_layout(layout, CFG, world)
    for w in words:
        assert w in str(err.value)


def test_every_problem_is_reported_at_once():
    problems = layout_problems(Layout(tp=3, zero=1), CFG, 2)
    assert len(problems) == 5   # world size, 3 divisibility checks, zero without dp


def test_experts_must_split_evenly():
    moe = dataclasses.replace(tiny_config("qwen3_moe"), n_experts=6)
    assert layout_problems(Layout(dp=3, ep=3), moe, 3) == []
    [problem] = layout_problems(Layout(dp=4, ep=4), moe, 4)
    assert "ep=4 does not divide n_experts=6" in problem
    [problem] = layout_problems(Layout(dp=4, ep=3), moe, 4)
    assert "ep=3 must divide dp=4" in problem
    # tensor parallelism splits each expert's features as well as the MLP's
    odd = dataclasses.replace(moe, moe_intermediate_size=9)
    [problem] = layout_problems(Layout(tp=2), odd, 2)
    assert "tp=2 does not divide the model's moe_intermediate_size=9" in problem


def test_parallelize_refuses_what_is_not_implemented():
    with pytest.raises(LayoutError, match="pipeline stages are `pipeline.PipelinedModel`"):
        parallelize(tiny_model(), Layout(pp=2))
    with pytest.raises(LayoutError, match="needs torch.distributed initialised"):
        parallelize(tiny_model(), Layout(dp=2))


@pytest.mark.parametrize("kw", [dict(dp=2, zero=2), dict(dp=1, zero=3)])
def test_offload_needs_zero3_over_dp(kw):
    with pytest.raises(ValueError, match="offload moves the shards of ZeRO-3 over dp ranks"):
        Layout(offload=True, **kw)


def test_one_rank_checkpoints_the_layers_its_layout_says_to():
    """A one-rank actor layout with activation checkpointing trains checkpointed layers, as
    the cost model prices it (found by rehearsal: one rank used to skip its layout)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from rlloom.models.config import ModelConfig
    from rlloom.models.transformer import CausalLM
    from rlloom.runtime.ranks import RankGroup
    cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=16, intermediate_size=32,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8)
    model, _ = RankGroup().trained(CausalLM(cfg), Layout(activation_checkpointing=True), 1e-3)
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.model.layers)
