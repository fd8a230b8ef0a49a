"""DeepSeek-V3 beyond the parity of tests/models/test_families.py: its routing against
values worked by hand, the released checkpoints' multi-token-prediction layer left out, and
the layout the executor does not run for it yet (tensor parallelism) refused and never
offered, the others it runs offered."""
import math

import torch
from safetensors.torch import load_file, save_file

from rlloom.models.hf_io import load_model
from rlloom.models.moe import Routing, route
from rlloom.parallel.mesh import layout_problems
from rlloom.perf.model.shapes import model_shape
from rlloom.plan import Layout
from tests.models.test_families import save_family


def test_routing_chooses_within_the_best_groups_by_biased_score():
    """8 experts in 4 groups of 2, the best 2 groups, top 2, scaled by 2.5. Biased scores
    (sigmoid + correction): group sums 0.9 + 0.6, 0.5 + 0.45, 0.8 + 0.95, 0.92 + 0.2, so
    groups 2 and 0; there the best are expert 5 (0.95) and expert 0 (0.9), and expert 6
    (0.92) is out with its group. Weights are the unbiased scores 0.7 and 0.9, renormalised
    and scaled: 0.7 / 1.6 x 2.5 = 1.09375 and 0.9 / 1.6 x 2.5 = 1.40625."""
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.8, 0.7, 0.92, 0.2]], dtype=torch.float64)
    logits = torch.log(scores / (1 - scores))
    bias = torch.tensor([0, 0.5, 0, 0, 0, 0.25, 0, 0], dtype=torch.float64)
    grouped = Routing(k=2, norm_topk_prob=True, sigmoid=True, n_group=4, topk_group=2,
                      scale=2.5)
    weights, experts = route(logits, grouped, bias)
    chosen = dict(zip(experts[0].tolist(), weights[0].tolist()))
    assert chosen.keys() == {5, 0}
    assert math.isclose(chosen[5], 1.09375) and math.isclose(chosen[0], 1.40625)
    # one group of all 8: expert 6 is in
    _, experts = route(logits, Routing(2, True, True, 1, 1, 2.5), bias)
    assert set(experts[0].tolist()) == {5, 6}


def test_routing_keeps_transformers_precision_in_a_bf16_copy(tmp_path):
    """A bf16 copy (the reference, a generation replica) keeps the correction bias in fp32,
    as it was loaded, and computes the router's logits in fp32: the same experts as the
    trained fp32 model wherever bf16 rounding would have moved a choice."""
    save_family(tmp_path, "deepseek_v3")
    model = load_model(tmp_path)
    gate = model.model.layers[1].mlp.gate
    bias = gate.e_score_correction_bias.clone()
    copy = load_model(tmp_path).to(torch.bfloat16)
    kept = copy.model.layers[1].mlp.gate.e_score_correction_bias
    assert kept.dtype == torch.float32 and torch.equal(kept, bias)
    x = torch.randn(4, 48)
    with torch.autocast("cpu", torch.bfloat16):
        assert gate(x).dtype == torch.float32


def test_the_multi_token_prediction_layer_is_left_out(tmp_path):
    """DeepSeek-V3's release holds layer 61 after its 61 layers (eh_proj, its own block):
    transformers skips it, and so does rlloom."""
    save_family(tmp_path, "deepseek_v3")
    state = load_file(tmp_path / "model.safetensors")
    ours = load_model(tmp_path)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(48, 96),
             "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(80, 16)}
    save_file({**state, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = load_model(tmp_path)
    assert set(again.state_dict()) == set(ours.state_dict())
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def test_layouts_it_does_not_split_are_refused_and_never_offered(tmp_path):
    from rlloom.perf.model.hardware import hardware
    from rlloom.perf.search.planner import layouts
    save_family(tmp_path, "deepseek_v3")
    cfg = load_model(tmp_path).config
    problems = layout_problems(Layout(tp=2), cfg, 2)
    assert any("tensor parallelism does not shard latent attention" in p for p in problems)
    for runs in (Layout(dp=2, zero=3), Layout(cp=2), Layout(dp=2, ep=2)):
        assert not layout_problems(runs, cfg, runs.world_size)
    from rlloom.plan import Plan, engine_problems
    assert engine_problems("vllm", Plan(), latent=True)  # the planner and VLLMEngine ask
    offered = layouts(8, model_shape(str(tmp_path)), hardware("h100"), True, runnable=True)
    assert offered and all(x.tp == 1 for x in offered)
    # (its 3 layers make no even pipeline stages)
    assert {x.cp for x in offered} > {1} and {x.ep for x in offered} > {1}
