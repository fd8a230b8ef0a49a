"""The measured side of the performance model: operator counts, empirical lengths, hardware
files, `rlloom perf validate` against hand computation, plan files and DPO pricing."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.perf.model import cost
from rlloom.perf.model.compose import price, role_models
from rlloom.perf.model.hardware import hardware, load_hardware
from rlloom.perf.model.shapes import ModelShape, model_shape
from rlloom.perf.model.workload import Lengths, Workload, lengths_from
from rlloom.perf.validation.validate import step_workload, validate_run
from rlloom.plan import Layout, Plan


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _counts(layers: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig("qwen3", 40, 32, 64, layers, 2, 1, 16, qk_norm=True))
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 40, (4, 10))
    with _Count() as fwd:
        model(ids, torch.ones_like(ids))
    model(ids).sum().backward()
    opt.step()  # the first step creates the optimizer state: count a later one
    model(ids).sum().backward()
    with _Count() as step:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return fwd.ops, step.ops


def test_operator_counts_match_the_runtime():
    """The per-layer / fixed operator counts the cost model uses are rlloom's own, within 15%."""
    (f1, o1), (f3, o3) = _counts(1), _counts(3)
    per_layer, fixed = (f3 - f1) / 2, f1 - (f3 - f1) / 2
    assert per_layer == pytest.approx(cost.FORWARD_OPS[0], rel=0.15)
    assert fixed == pytest.approx(cost.FORWARD_OPS[1], rel=0.15)
    assert (o3 - o1) / 2 == pytest.approx(cost.OPTIMIZER_OPS[0], rel=0.15)


def test_training_operator_counts_match_the_runtime(tmp_path, tiny):
    """TRAIN_OPS: the operators one training pass dispatches (forward, backward and the
    objective), counted on the runtime's training stage of 1- and 3-layer models, against the
    cost model's passes (a shared prompt pass and response micro-batches) of the same steps;
    within 15%. Measured here 277 per layer and 167 fixed (with 8 prompts and 64-token
    responses: 267 and 210)."""
    from rlloom.perf.validation.validate import step_workload
    from rlloom.runtime.executor.launch import local_loop
    unit = replace(FREE, launch_s=1.0)  # priced seconds = priced operators
    per_mb = {}
    for layers in (1, 3):
        cfg = load_config(None, [*tiny, f"model.layers={layers}", "algo.kl_coef=0",
                                 "rollout.temperature=1.5", f"run_dir={tmp_path / str(layers)}"])
        loop = local_loop(cfg, tmp_path / str(layers))
        loop.ex.start()
        host = loop.ex.worker.training
        train, counts = host.train, []

        def counted(*args, train=train, counts=counts):
            with _Count() as c:
                out = train(*args)
            counts.append(c.ops)
            return out
        host.train = counted
        shape = model_shape(str(loop.model_path))
        ops = []
        for _ in range(2):
            wl = step_workload(loop.train_step(), cfg)
            steps, layout = wl.ppo_epochs * wl.minibatches, Layout()
            priced = cost.training(shape, layout, wl, unit, "actor", prompts_once=True).seconds
            micro = (priced / steps - cost._ops(cost.OPTIMIZER_OPS, shape, layout)) / \
                cost._ops(cost.TRAIN_OPS, shape, layout)  # the model's micro-batches per step
            ops.append((counts[-1] / steps - cost._ops(cost.OPTIMIZER_OPS, shape, layout))
                       / micro)
        loop.ex.stop()
        per_mb[layers] = sum(ops) / len(ops)
    per_layer = (per_mb[3] - per_mb[1]) / 2
    assert per_layer == pytest.approx(cost.TRAIN_OPS[0], rel=0.15)
    assert per_mb[1] - per_layer == pytest.approx(cost.TRAIN_OPS[1], rel=0.15)


def test_engine_decode_operator_counts():
    from rlloom.rollout.engine import EngineConfig, engine_generate
    from rlloom.rollout.sampling import SamplingParams
    counts = {}
    for layers in (1, 3):
        torch.manual_seed(0)
        model = CausalLM(ModelConfig("qwen3", 40, 32, 64, layers, 2, 1, 16, qk_norm=True))
        for steps in (9, 17):  # 8 more decode steps, two KV growth chunks apart
            with _Count() as c:
                engine_generate(model, [[1, 2, 3, 4]] * 8, SamplingParams(steps, 1.0), 999, 0,
                                torch.Generator().manual_seed(0), EngineConfig(n_samples=8))
            counts[layers, steps] = c.ops
    step = {n: (counts[n, 17] - counts[n, 9]) / 8 for n in (1, 3)}
    per_layer = (step[3] - step[1]) / 2
    assert per_layer == pytest.approx(cost.DECODE_OPS[0], rel=0.15)
    assert step[1] - per_layer == pytest.approx(cost.DECODE_OPS[1], rel=0.15)


def test_activation_traffic_matches_the_runtime():
    """Elements read + written by non-matmul, non-view operators per token of a forward
    grow by ACT_PER_LAYER = (50 x hidden + 5 x ffn) per layer, within 20%."""
    from rlloom.perf.model.shapes import ACT_PER_LAYER
    skip = {"mm", "addmm", "bmm", "view", "_unsafe_view", "transpose", "slice", "expand",
            "as_strided", "t", "unsqueeze", "squeeze", "select", "permute", "detach", "alias",
            "split", "split_with_sizes", "unbind", "empty", "lift_fresh", "_to_copy"}

    class Traffic(TorchDispatchMode):
        elems = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] not in skip:
                ts = [*(out if isinstance(out, (tuple, list)) else [out]), *args]
                Traffic.elems += sum(t.numel() for t in ts if isinstance(t, torch.Tensor))
            return out

    def per_token(hidden: int, ffn: int, layers: int) -> float:
        Traffic.elems = 0
        model = CausalLM(ModelConfig("qwen3", 98, hidden, ffn, layers, 4, 2, hidden // 4,
                                     qk_norm=True))
        ids = torch.randint(0, 98, (16, 40))
        with torch.no_grad(), Traffic():
            model(ids, torch.ones_like(ids))
        return Traffic.elems / ids.numel()

    per_layer = per_token(128, 384, 3) - per_token(128, 384, 2)
    assert per_layer == pytest.approx(ACT_PER_LAYER[0] * 128 + ACT_PER_LAYER[1] * 384, rel=0.2)
    wider = per_token(128, 768, 3) - per_token(128, 768, 2)
    assert (wider - per_layer) / 384 == pytest.approx(ACT_PER_LAYER[1], rel=0.2)


def test_length_buckets_pad_like_the_runtime():
    """4 rows of prompt 10 and responses 2, 2, 10, 30 with a 60-token budget: the 4 distinct
    prompts run once (40 tokens); of the responses the cheapest cut keeps [2, 2, 10]
    (3 x 10 = 30) and puts the 30-token one alone (the other feasible cut, [2, 2] + [10, 30],
    pads to 4 + 60): 40 + 60 tokens in 1 + 2 passes. The runtime's plain (torchrun) path
    cuts prompt + response widths the same way."""
    from rlloom.runtime.stages.packing import micro_batches
    wl = Workload(4, 1, 10, Lengths.empirical([2, 2, 10, 30]), micro_batch_tokens=60)
    assert wl.teacher_forced(4, prompts_once=True) == (100, 3)
    # a value head runs prompt + response: [12, 12, 20] (3 x 20) and [40]
    assert wl.teacher_forced(4) == (100, 2)
    groups = micro_batches(torch.tensor([10] * 4), torch.tensor([2, 2, 10, 30]), 60)
    assert [len(g) for g in groups] == [3, 1]
    assert Workload(4, 1, 10, Lengths("fixed", 5)).teacher_forced(4) == (60, 1)   # packed
    # 2 prompts x K=4: all 8 rows hold both prompts; 2 random rows of 8 miss one prompt with
    # probability C(4, 2) / C(8, 2) each, so they hold 2 (1 - 6/28) = 11/7 on average
    grpo = Workload(2, 4, 10, Lengths("fixed", 5), micro_batch_tokens=60)
    assert grpo.distinct_prompts(8) == 2 and grpo.distinct_prompts(2) == pytest.approx(11 / 7)
    # their responses cost 5 tokens each, but hold their prompt's keys: 4 rows x (10 + 5) fill
    # the 60-token budget, so 2 micro-batches after the prompt pass
    assert grpo.teacher_forced(8, prompts_once=True) == (2 * 10 + 8 * 5, 3)


def test_empirical_lengths():
    lengths = Lengths.empirical([5, 1, 3, 3])
    assert lengths.values == (1, 3, 3, 5)
    assert (lengths.mean, lengths.max, lengths.p50) == (3, 5, 3)
    assert lengths.spread(4) == (1, 3, 3, 5)
    with pytest.raises(ValueError, match="at least one length"):
        Lengths("empirical")


def test_lengths_from(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "response_lens": [4, 2]}) + "\n"
        + json.dumps({"step": 2, "response_lens": [6]}) + "\n")
    assert lengths_from(tmp_path).values == (2, 4, 6)
    with pytest.raises(ValueError, match="not found"):
        lengths_from(tmp_path / "nope")
    (tmp_path / "lens.json").write_text("[30, 10, 20]")
    (tmp_path / "lens.txt").write_text("30\n10\n20\n")
    assert lengths_from(tmp_path / "lens.json").values == (10, 20, 30)
    assert lengths_from(tmp_path / "lens.txt").values == (10, 20, 30)
    (tmp_path / "bad.txt").write_text("ten\n")
    with pytest.raises(ValueError, match="one number per line"):
        lengths_from(tmp_path / "bad.txt")


# A device whose arithmetic, memory and links are free: only operator dispatch costs time, so
# every stage is an operator count times launch_s.
LAUNCH = 1e-3
FREE = replace(hardware("h100"), peak_flops={"fp32": 1e30, "bf16": 1e30}, mem_bw=1e30,
               launch_s=LAUNCH)


def test_validate_predicts_dispatch_bound_stages_by_hand(fake_run):
    run = fake_run([5, 5, 5, 5])  # 2 prompts x K=2, every response 5 tokens
    points = validate_run(run, FREE, skip=1)
    assert [p.step for p in points] == [2, 2, 2]
    by = {p.stage: p.predicted_s for p in points}
    fwd, dec = 87 * 2 + 45, 77 * 2 + 123  # FORWARD_OPS and DECODE_OPS for 2 layers
    # generation: one prefill, then 4 decode steps (token 1 comes out of prefill)
    assert by["generation"] == pytest.approx(LAUNCH * (fwd + 4 * dec))
    # assessment: the reference runs the 2 prompts in one pass, then the 4 responses in one
    # length bucket: 2 forwards
    assert by["assessment"] == pytest.approx(LAUNCH * 2 * fwd)
    # training: 2 epochs x 2 mini-batches, each a prompt pass and a response bucket (forward,
    # backward and objective: TRAIN_OPS) and an optimizer step
    assert by["training"] == pytest.approx(LAUNCH * 4 * (2 * (270 * 2 + 185) + 110 * 2 + 42))
    assert points[0].error == pytest.approx(by["generation"] - 1.0)
    # the stages' own host time per operator (`rlloom bench hw` measures them) replaces the
    # plain forward's in assessment and training only
    staged = replace(FREE, assess_launch_s=3 * LAUNCH, train_launch_s=2 * LAUNCH)
    again = {p.stage: p.predicted_s for p in validate_run(run, staged, skip=1)}
    assert again == pytest.approx({"generation": by["generation"],
                                   "assessment": 3 * by["assessment"],
                                   "training": 2 * by["training"]})


def test_data_parallel_wrappers_cost_where_the_runtime_has_them():
    """FSDP2 wraps each decoder layer and the root of a data-parallel model that trains (and
    ZeRO-3 of a frozen one): wrapped_pass_s per wrapped module per micro-batch; clipping and
    AdamW run on DTensor parameters under DP or TP: sharded_launch_s per optimizer operator.
    A frozen model's plain dp replicas pay neither. By hand: 1 epoch x 1 mini-batch of one
    micro-batch."""
    shape = model_shape("qwen2.5-0.5b")
    wl = Workload(prompts=2, samples=2, prompt_len=8, response=Lengths("fixed", 8),
                  micro_batch=4)
    hooks, per_op = 3e-3, 2e-4
    dear = replace(FREE, wrapped_pass_s=hooks, sharded_launch_s=per_op)
    wrapped, opt = shape.layers + 1, 110 * shape.layers + 42

    def added(stage, layout, **kw):
        return stage(shape, layout, wl, dear, "actor", **kw).seconds - \
            stage(shape, layout, wl, FREE, "actor", **kw).seconds
    assert added(cost.training, Layout(dp=2)) == pytest.approx(hooks * wrapped + per_op * opt)
    assert added(cost.training, Layout(tp=2)) == pytest.approx(per_op * opt)
    assert added(cost.training, Layout()) == 0
    assert added(cost.forward, Layout(dp=2)) == 0
    assert added(cost.forward, Layout(dp=2, zero=3)) == pytest.approx(hooks * wrapped)
    assert added(cost.forward, Layout(dp=2), trained=True) == pytest.approx(hooks * wrapped)


def test_validate_rejects_a_run_without_lengths(fake_run):
    run = fake_run([5])
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "gen_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no response_lens"):
        validate_run(run, FREE)


def test_hardware_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("RLLOOM_CACHE", str(tmp_path))
    with pytest.raises(KeyError, match="run `rlloom bench hw`"):
        hardware("local")
    (tmp_path / "hardware").mkdir()
    FREE.save(tmp_path / "hardware" / "local.json")
    assert hardware("local") == load_hardware(tmp_path / "hardware" / "local.json") == FREE


def test_plan_file_is_a_config_rlloom_train_reads(tmp_path, capsys):
    from rlloom.cli import main
    path = tmp_path / "plan.yaml"
    main(["plan", "--gpus", "16xH100", "--p50", "1024", "--p99", "8192", "--write-plan",
          str(path)])
    assert f"wrote the best plan to {path}" in capsys.readouterr().out
    cfg = load_config(path)
    assert cfg.plan.layouts["actor"].world_size > 1
    assert cfg.train.steps == load_config().train.steps  # every other setting at its default
    # the priced micro-batch of sequences at the longest context: prompt 512 + the p99
    longest = 512 + Lengths("lognormal", 1024, 8192).max
    assert cfg.train.micro_batch_tokens / longest in (1, 2, 4, 8, 16)


def test_rollout_layout_in_the_plan_is_the_generation_layout():
    shape, hw = model_shape("qwen2.5-7b"), hardware("h100")
    wl = Workload(64, 8, 512, Lengths("lognormal", 1024, 8192))
    models = role_models(shape, ("actor", "reference"))
    layouts = {"actor": Layout(dp=4, zero=1), "reference": Layout(dp=4)}
    gen = Layout(dp=2, tp=2)
    given = price(Plan(placement="disaggregated", layouts=layouts), models, wl, hw, gen)
    in_plan = price(Plan(placement="disaggregated", layouts={**layouts, "generation": gen}),
                    models, wl, hw)
    assert in_plan.gen_s == given.gen_s and in_plan.step_s == given.step_s


def test_dpo_prices_no_generation():
    shape, hw = model_shape("qwen2.5-7b"), hardware("h100")
    wl = Workload(64, 2, 512, Lengths("fixed", 512))
    models = role_models(shape, ("actor", "reference"))
    plan = Plan(layouts={"actor": Layout(dp=8, zero=3), "reference": Layout(dp=8)})
    online, offline = price(plan, models, wl, hw), price(plan, models, wl, hw, offline=True)
    assert offline.gen_s == 0 < online.gen_s
    assert offline.step_s == pytest.approx(online.step_s - online.gen_s)


def test_hybrid_colocated_layout_pays_resharding():
    """TP generation and FSDP training on the same 8 devices: generation runs on them (no
    generation group) and each step pays one all-gather of a device's generation share of the
    bf16 weights (its TP shard of the layers, the embeddings and head whole): (8-1) (alpha + share/8/bw). Generating in the training layout itself does
    too: data-parallel replicas decode on whole copies (`plan.needs_generation_copy`), each
    all-gathering the whole model."""
    from rlloom.perf.model import memory as mem
    shape, hw = model_shape("qwen2.5-7b"), hardware("h100")
    wl = Workload(64, 8, 512, Lengths("fixed", 1024))
    models = role_models(shape, ("actor",))
    train, gen = Layout(dp=8, zero=3), Layout(dp=4, tp=2)
    hybrid = price(Plan(layouts={"actor": train, "generation": gen}), models, wl, hw)
    plain = price(Plan(layouts={"actor": train}), models, wl, hw)
    share = mem.PARAM_B * mem.params_per_device(shape, gen)  # TP keeps embeddings whole
    alpha, bw = hw.intra_node_latency, hw.intra_node_bw * hw.comm_eff
    assert hybrid.sync_s == pytest.approx(7 * (alpha + share / 8 / bw))
    whole = mem.PARAM_B * shape.params
    assert plain.sync_s == pytest.approx(7 * (alpha + whole / 8 / bw))
    assert hybrid.devices == plain.devices == 8
    # TP 2 all-reduces twice a layer in every decode step, where replicas need nothing
    assert hybrid.stages[0].comm_s > plain.stages[0].comm_s


def test_expert_parallel_prices_all_to_all():
    shape, hw = model_shape("qwen3-30b-a3b"), hardware("h100")
    wl = Workload(64, 8, 512, Lengths("fixed", 1024))
    no_ep = cost.training(shape, Layout(dp=8), wl, hw, "actor")
    ep = cost.training(shape, Layout(dp=8, ep=8), wl, hw, "actor")
    assert ep.comm_s > no_ep.comm_s
    assert ep.compute_s == no_ep.compute_s


def test_hardware_files_are_written_whole(tmp_path):
    path = tmp_path / "hw" / "local.json"
    FREE.save(path)
    assert load_hardware(path) == FREE and not list(path.parent.glob("*.tmp"))


def test_hardware_file_in_yaml_prices_a_plan(tmp_path, capsys):
    """`rlloom plan --hardware FILE --gpus N`: a YAML hardware file (1e15 without a dot, as
    people write it) stands for a catalogue name; a wrong field is named with the fix."""
    (tmp_path / "gpu.yaml").write_text(
        "name: my-gpu\npeak_flops: {bf16: 1e15, fp32: 6.7e13}\nmem_gib: 80\nmem_bw: 3.35e12\n"
        "intra_node_bw: 4.5e11\ninter_node_bw: 5e10\n")
    main(["plan", "--gpus", "16", "--hardware", str(tmp_path / "gpu.yaml"), "--model",
          "qwen2.5-0.5b", "--prompts", "64", "--p50", "256", "--p99", "2048", "--top", "1"])
    out = capsys.readouterr().out
    assert "on 16 x my-gpu" in out
    assert load_hardware(tmp_path / "gpu.yaml").peak_flops["bf16"] == 1e15
    (tmp_path / "bad.yaml").write_text("name: x\nmem_gib: 80\nhbm: 3\n")
    with pytest.raises(ValueError, match=r"unknown fields \['hbm'\]; missing fields"):
        load_hardware(tmp_path / "bad.yaml")


def test_the_documented_hardware_file_plans(tmp_path, capsys):
    """The YAML example of docs/performance-model.md section 8, copied as is, prices a plan."""
    doc = (Path(__file__).parents[2] / "docs" / "performance-model.md").read_text()
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "l40s.yaml").write_text(example)
    hw = load_hardware(tmp_path / "l40s.yaml")
    assert (hw.peak_flops["bf16"], hw.intra_node_bw, hw.dispatch_overlap) == (362e12, 25e9, 1.0)
    main(["plan", "--gpus", "16", "--hardware", str(tmp_path / "l40s.yaml"), "--model",
          "qwen2.5-0.5b", "--prompts", "64", "--p50", "256", "--p99", "2048", "--top", "1"])
    assert "on 16 x l40s" in capsys.readouterr().out


def test_max_response_caps_lognormal_lengths_with_a_mass_at_the_cap():
    """p50 100, p99 1000: sigma = ln 10 / z99 = 0.98985. Cut at 500 the lognormal puts
    1 - Phi(ln 5 / sigma) = 1 - Phi(1.6259) = 5.20% of responses at the cap; the default cap
    is p99 (1%)."""
    capped = Lengths("lognormal", 100, 1000, cap=500)
    assert capped.max == 500 and capped.at_cap == pytest.approx(0.0520, abs=2e-4)
    assert capped.quantile(0.96) == 500 and capped.quantile(0.94) < 500
    assert Lengths("lognormal", 100, 1000).at_cap == pytest.approx(0.01)
    with pytest.raises(ValueError, match="must exceed the median"):
        Lengths("lognormal", 100, 1000, cap=50)


def test_async_ppo_pays_the_proximal_forward_it_runs():
    """Stale samples of a ppo loss are corrected (corrections.decoupled): the trainer recomputes the
    actor's log-probs over every rollout first. By hand on the dispatch-only device: 16
    rollouts of 5 tokens after 7 prompt tokens in one micro-batch is one forward, 87 x 2 + 45
    operators. Sync, and a REINFORCE loss (no correction), pay nothing."""
    shape = ModelShape.from_hf_config({
        "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "vocab_size": 40}, "tiny")
    models = role_models(shape, ("actor", "reward"))
    wl = Workload(prompts=8, samples=2, prompt_len=7, response=Lengths("fixed", 5),
                  micro_batch=16)
    sync = Plan(placement="disaggregated")
    stale = Plan(placement="disaggregated", schedule="async", staleness=1)

    def train_s(plan, loss="ppo"):
        return price(plan, models, replace(wl, policy_loss=loss), FREE).train_s
    assert train_s(stale) - train_s(sync) == pytest.approx(LAUNCH * (87 * 2 + 45))
    assert train_s(stale, "reinforce") == pytest.approx(train_s(sync, "reinforce"))


def test_partial_rollout_and_staleness_reach_the_plan_and_its_file(tmp_path, capsys):
    """--partial-rollout prices every plan with carried responses and writes the setting (with
    the response limit rounded up to whole chunks) into the plan file; --staleness sets the
    async plans' bound."""
    path = tmp_path / "plan.yaml"
    args = ["plan", "--gpus", "16xH100", "--p50", "1024", "--p99", "8000", "--json",
            "--top", "200"]
    main(args)
    whole = json.loads(capsys.readouterr().out)
    main([*args, "--partial-rollout", "3000", "--staleness", "2", "--write-plan", str(path)])
    out = capsys.readouterr().out
    chunked = json.loads(out[out.index("{"):])
    assert chunked["workload"]["partial_tokens"] == 3000
    # priced otherwise: each step's tail is a chunk, carried responses prefill again
    assert chunked["ranked"][0]["gen_s"] != whole["ranked"][0]["gen_s"]
    cfg = load_config(path)
    assert cfg.rollout.partial_tokens == 3000 and cfg.rollout.max_new_tokens == 9000
    bounds = {r["plan_json"]["staleness"] for r in chunked["ranked"]
              if r["plan_json"]["schedule"] == "async"}
    assert bounds == {2}


@pytest.mark.parametrize("overrides, recompute", [
    ([], False), (["algo.rollout_is=token_tis"], True), (["rollout.engine=vllm"], True)])
def test_the_recomputed_behaviour_forward_is_priced_when_the_runtime_runs_it(overrides,
                                                                          recompute):
    """The trainer's recompute of the sampler's log-probs (rollout_correction) costs one
    forward of the actor over every rollout, in the training stage, exactly when the runtime
    does it."""
    cfg = load_config(None, overrides)
    row = {"response_lens": [20] * 64, "prompt_len": 12.0}
    wl = step_workload(row, cfg)
    assert wl.recompute_logprobs is recompute
    shape = model_shape("qwen2.5-0.5b")
    priced = price(Plan(), {"actor": shape, "reference": shape}, wl, hardware("h100"))
    extra = [s for s in priced.stages if s.note == "old log-probs"]
    assert len(extra) == int(recompute)
    if recompute:
        plain = price(Plan(), {"actor": shape, "reference": shape},
                      replace(wl, recompute_logprobs=False), hardware("h100"))
        assert extra[0].stage == "training"
        assert priced.train_s == pytest.approx(plain.train_s + extra[0].seconds)
