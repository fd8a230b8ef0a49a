"""What the planner searches beyond layouts: the micro-batch size and interleaved placement."""
from dataclasses import replace

import pytest

from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import MODELS
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import MICRO_BATCHES, Search, _search_at, layouts, search
from rlloom.plan import Layout

Q7 = MODELS["qwen2.5-7b"]
H100 = hardware("h100")
LONG = Workload(512, 8, 512, Lengths("lognormal", 2048, 16384))


def test_micro_batch_trades_activation_memory_for_passes():
    """ZeRO-3 over 8 devices, 64 rows each: the layers' activations grow linearly with the
    micro-batch (the logits' one chunk does not: every micro-batch here fills it) while the
    per-micro-batch gathers (3 per pass, 64 / mb passes) shrink as 1 / mb."""
    wl = Workload(64, 8, 512, Lengths("fixed", 512))
    lay = Layout(dp=8, zero=3)
    c = {mb: cost.training(Q7, lay, replace(wl, micro_batch=mb), H100, "actor")
         for mb in (1, 2, 4)}
    assert c[4].transient_bytes - c[2].transient_bytes == pytest.approx(
        2 * (c[2].transient_bytes - c[1].transient_bytes))
    assert wl.max_context >= mem.LOGIT_CHUNK
    act_one = mem.activation_bytes(Q7, lay, 1 * wl.max_context, False)
    assert c[2].transient_bytes - c[1].transient_bytes == pytest.approx(act_one)
    # comm = A * 64 / mb + (optimizer launches): the drop from 1 to 2 is twice that from 2 to 4
    assert c[1].comm_s - c[2].comm_s == pytest.approx(2 * (c[2].comm_s - c[4].comm_s))
    # the same tokens either way; from 1,024 response tokens a micro-batch on, the head's
    # chunks are checkpointed and recomputed: one more head forward over 4 x 512 tokens
    rows = 8 * 64 * 512
    assert c[4].flops - c[1].flops == pytest.approx(rows * Q7.head_flops)


def _at(micro_batch: int, hw_name: str, devices: int) -> list:
    found = Search([])
    _search_at(Q7, "grpo", replace(LONG, micro_batch=micro_batch), hardware(hw_name), devices,
               None, found)
    return found.ranked


def test_search_picks_the_micro_batch_memory_allows():
    """On 64 A100-40GB with 16k-token tails the micro-batch size matters: the search ranks the
    fastest plan over every size (priced on 2026-12-07: best at 2 rows per micro-batch, the
    best at 16 rows 18% slower), and at 16 rows, with more activations, fewer plans fit:
    only those that split each sequence over the actor's cp x tp ranks."""
    res = search(Q7, "grpo", LONG, hardware("a100-40gb"), 64)
    best = res.ranked[0]
    at = {mb: _at(mb, "a100-40gb", 64) for mb in MICRO_BATCHES}
    assert best.step_s == min(p.step_s for mb in MICRO_BATCHES for p in at[mb])
    assert min(p.step_s for p in at[16]) > 1.10 * best.step_s
    assert 0 < len(at[16]) < len(at[8])
    assert all(p.plan.layout("actor").cp * p.plan.layout("actor").tp > 1 for p in at[16])


def test_interleaved_puts_actor_and_critic_on_one_group():
    res = search(Q7, "ppo", LONG, H100, 64)
    inter = [p for p in res.ranked if p.plan.placement == "interleaved"]
    # fused would price as sync: the critic's forward runs on the generating group
    assert inter and {p.plan.schedule for p in inter} == {"sync"}
    for p in inter:
        actor, critic = p.plan.layout("actor"), p.plan.layout("critic")
        frozen = p.plan.layout("reference")
        assert actor.world_size == critic.world_size and p.devices == 64
        assert actor.world_size + frozen.world_size == 64
        # both trainable models are resident on the trainable group's devices
        both = mem.model_state_bytes(Q7, actor, True) + mem.model_state_bytes(Q7, critic, True)
        assert p.mem_gib["trainable"] * 2**30 >= both
    # with one trainable role, interleaved is disaggregated: not listed twice
    assert not [p for p in search(Q7, "grpo", LONG, H100, 64).ranked
                if p.plan.placement == "interleaved"]


def test_expert_parallel_is_searched_for_moe_models():
    moe = MODELS["qwen3-30b-a3b"]
    cands = layouts(16, moe, H100, trainable=True)
    assert {x.ep for x in cands} == {1, 2, 4, 8, 16}
    assert all(moe.n_experts % x.ep == 0 and x.dp % x.ep == 0 for x in cands)
    assert {x.ep for x in layouts(16, Q7, H100, trainable=True)} == {1}  # dense: no experts
    ranked = search(moe, "grpo", LONG, H100, 64).ranked
    assert any(p.plan.layout("actor").ep > 1 for p in ranked)


def test_routed_experts_are_priced_as_the_runtime_holds_them():
    """Under EP the runtime leaves the routed experts out of ZeRO (each whole on its owners)
    and sums their gradients over the dp / ep owners of the same experts: 16 bytes per
    expert parameter on each owner beside the ZeRO-sharded rest, and an all-reduce of expert
    gradients only when ep < dp."""
    moe = MODELS["qwen3-30b-a3b"]
    experts = moe.layers * (moe.mlp_params - moe.hidden * moe.n_experts)
    x = Layout(dp=8, ep=8, zero=3)
    rest = moe.params - experts
    assert mem.model_state_bytes(moe, x, True) == pytest.approx(16 * rest / 8 + 16 * experts / 8)
    # ep=4 within dp=8: two owners per expert all-reduce their fp32 gradients; the rest is
    # gathered in bf16 once and its fp32 gradients reduce-scattered (ZeRO-2)
    rest = mem.params_per_device(moe, Layout(dp=8, ep=4)) - experts / 4
    assert _dp_records(moe, Layout(dp=8, ep=4, zero=2), 1) == {
        "all_reduce": (2, 4 * experts / 4, 1), "all_gather": (8, 2 * rest, 1),
        "reduce_scatter": (8, 4 * rest, 1)}
    rest = mem.params_per_device(moe, Layout(dp=8, ep=8)) - experts / 8
    assert _dp_records(moe, Layout(dp=8, ep=8, zero=2), 1) == {  # one owner each: no all-reduce
        "all_gather": (8, 2 * rest, 1), "reduce_scatter": (8, 4 * rest, 1)}


def _dp_records(shape, layout, micro_batches):
    return {c.kind: (c.size, pytest.approx(c.nbytes), c.calls)
            for c in cost.comm.dp(shape, layout, micro_batches)}


def test_data_parallel_collectives_per_step_are_those_the_runtime_issues():
    """`data_parallel.before_backward` with bf16 compute, over 4 micro-batches: ZeRO-0/1
    all-reduce the fp32 gradients once, and ZeRO-1's ranks then broadcast the fp32
    parameters each stepped; ZeRO-2 gathers the bf16 parameters once and reduce-scatters the
    fp32 gradients in each of the 4 backwards; ZeRO-3 gathers twice and scatters once per
    micro-batch. (`tests/perf/test_rehearsal.py` holds these bytes against the ones the
    runtime sends.)"""
    p = mem.params_per_device(Q7, Layout(dp=8))
    assert _dp_records(Q7, Layout(dp=8, zero=0), 4) == {"all_reduce": (8, 4 * p, 1)}
    assert _dp_records(Q7, Layout(dp=8, zero=1), 4) == {"all_reduce": (8, 4 * p, 1),
                                                       "broadcast": (8, 4 * p, 8)}
    assert _dp_records(Q7, Layout(dp=8, zero=2), 4) == {"all_gather": (8, 2 * p, 1),
                                                       "reduce_scatter": (8, 16 * p, 4)}
    # the root (embeddings, head, final norm) is gathered once: FSDP keeps it to backward
    root = p - Q7.layers * mem.layer_params(Q7, Layout(dp=8))
    assert root == pytest.approx(2 * Q7.vocab * Q7.hidden + Q7.hidden)
    assert _dp_records(Q7, Layout(dp=8, zero=3), 4) == {
        "all_gather": (8, 4 * (2 * p + 2 * (p - root)), 8), "reduce_scatter": (8, 16 * p, 4)}
    # a member sends 7/8 of each gathered or scattered buffer on a ring of 8, 14/8 of an
    # all-reduced one, and a whole broadcast
    assert cost.comm.sent(cost.comm.dp(Q7, Layout(dp=8, zero=3), 4)) == pytest.approx(
        7 / 8 * (16 * p + 8 * (2 * p - root)))
    assert cost.comm.sent(cost.comm.dp(Q7, Layout(dp=8, zero=1), 4)) == pytest.approx(
        14 / 8 * 4 * p + 4 * p)
    grads = cost.comm.Collective("all_reduce", 8, 8, 4 * p)
    # a machine whose replicate all-reduce costs 50 ms a wrapped module under load
    # (`Hardware.reduce_s`, measured by `rlloom bench hw`): the floor over 28 layers + root
    slow = replace(H100, reduce_s=0.05)
    assert cost.comm.dp_comm(Q7, Layout(dp=8), slow, 4) == pytest.approx(0.05 * 29)
    assert cost.comm.dp_comm(Q7, Layout(dp=8), replace(H100, reduce_s=1e-9), 4) == pytest.approx(
        grads.seconds(H100))       # the link model when it is larger
    assert cost.comm.dp_comm(Q7, Layout(), slow, 4) == 0.0   # one rank reduces nothing


def test_context_parallel_is_searched():
    cands = layouts(16, Q7, H100, trainable=True)
    assert {x.cp for x in cands} == {1, 2, 4}
    assert all(x.world_size == 16 for x in cands)
    very_long = Workload(512, 8, 512, Lengths("lognormal", 8192, 65536))
    ranked = search(Q7, "grpo", very_long, H100, 64, price_only=True).ranked
    assert any(p.plan.layout("actor").cp > 1 for p in ranked)


def test_cost_objective_needs_a_price():
    unpriced = replace(H100, price_per_hour=0.0)
    with pytest.raises(ValueError, match="hardware h100 has no price per device-hour"):
        search(Q7, "grpo", LONG, unpriced, 8, objective="cost")


def test_epochs_and_minibatches_reach_the_workload():
    """Two PPO epochs of four optimizer steps: training computes the batch twice over, and
    the DP gradient all-reduce runs after each of the 8 optimizer steps instead of once."""
    from rlloom.perf.search.report import Request
    req = Request("qwen2.5-7b", "ppo", "64xH100", 512, 8, 512, 2048, 16384, epochs=2,
                  minibatches=4)
    wl = req.workload()
    assert (wl.ppo_epochs, wl.minibatches) == (2, 4)
    once = cost.training(Q7, Layout(dp=64, zero=1), replace(wl, ppo_epochs=1, minibatches=1),
                         H100, "actor")
    twice = cost.training(Q7, Layout(dp=64, zero=1), wl, H100, "actor")
    assert twice.flops == pytest.approx(2 * once.flops)
    zero_dp = replace(H100, launch_s=0.0)
    ar = {n: cost.training(Q7, Layout(dp=64, zero=1), replace(wl, ppo_epochs=1, minibatches=n),
                           zero_dp, "actor").comm_s for n in (1, 2)}
    both = cost.training(Q7, Layout(dp=64, zero=1), wl, zero_dp, "actor").comm_s
    assert both == pytest.approx(8 * ar[1]) and ar[2] == pytest.approx(2 * ar[1])


def test_vllm_generation_is_priced_paged_and_searched_on_whole_copies():
    """rollout.engine=vllm: a rollout holds the KV blocks it has filled (on average its mean
    context; the longest must fit alone), at most VLLM_MAX_SEQS at once, where rlloom's
    engine reserves a slot of the longest context; and the planner ranks only generation
    layouts without tp, which the vLLM server runs (plan.engine_problems)."""
    wl = Workload(64, 8, 512, Lengths("lognormal", 2048, 16384))
    on_vllm = replace(wl, engine="vllm")
    x, budget = Layout(), 40 * 2**30
    slot = mem.kv_bytes_per_rollout(Q7, x, wl.max_context)
    paged = mem.kv_bytes_per_rollout(Q7, x, wl.mean_context)
    # rlloom's engine: its slot rule, the longest context's KV beside its working memory
    slots = mem.generation_slots(Q7, 1, budget, slot, 512, False, 512, 16384)
    assert 0 < slots < int(budget // slot) < int(budget // paged) < 512
    assert cost.generation(Q7, x, wl, H100, budget).note.startswith(f"{slots} of 512 rollouts")
    # vLLM: what is left of the budget beside its own weights and one batched forward
    kv = budget - 2 * mem.params_per_device(Q7, x) - 16384 * mem.prefill_bytes_per_token(Q7, 1)
    assert mem.vllm_kv_bytes(Q7, 1, budget) == kv
    assert cost.generation(Q7, x, on_vllm, H100, budget).note.startswith(
        f"{min(cost.VLLM_MAX_SEQS, int(kv // paged))} of 512 rollouts")
    assert cost.generation(Q7, x, on_vllm, H100, budget).transient_bytes == budget
    assert cost.generation(Q7, x, on_vllm, H100, slot / 2).seconds == float("inf")
    found = search(Q7, "grpo", replace(LONG, engine="vllm"), H100, 8)
    assert all((p.gen_layout or p.plan.layout("actor")).tp == 1 for p in found.ranked)
    # whole copies are what the search tries, not what it rejects afterwards: every placement
    # and schedule rlloom's engine gets is searched on vLLM too
    kinds = {(p.plan.placement, p.plan.schedule) for p in found.ranked}
    assert kinds == {(p.plan.placement, p.plan.schedule)
                     for p in search(Q7, "grpo", LONG, H100, 8).ranked}
    assert not any("rollout.engine=vllm" in why for _, why in found.rejected)


def test_a_smaller_critic_is_priced_at_its_own_shape(tmp_path, capsys):
    """`--critic`: the critic's training and values pass cost its own FLOPs, its state its own
    bytes, and the plan file starts it from the checkpoint."""
    from rlloom.cli import main
    from rlloom.config import load_config
    from rlloom.perf.model.compose import price, role_models
    from rlloom.plan import Plan

    small = MODELS["qwen2.5-1.5b"]
    wl = Workload(64, 8, 512, Lengths("fixed", 1024))
    x = Layout(dp=8, zero=3)
    plan = Plan(layouts={"actor": x, "critic": x, "reference": Layout(dp=8)})
    own = price(plan, role_models(Q7, ("actor", "critic", "reference"), critic=small), wl, H100)
    critic = {s.stage: s for s in own.stages if s.role == "critic"}
    assert critic["training"].flops == cost.training(small, x, wl, H100, "critic", False).flops
    assert critic["assessment"].flops < 0.3 * [s for s in own.stages if s.role == "reference"][
        0].flops
    same = price(plan, role_models(Q7, ("actor", "critic", "reference")), wl, H100)
    assert same.mem_gib["all"] - own.mem_gib["all"] == pytest.approx(
        16 * (Q7.params - small.params) / 8 / 2**30, rel=1e-6)
    assert search(Q7, "ppo", wl, H100, 4, critic=small).ranked[0].step_s < \
        search(Q7, "ppo", wl, H100, 4).ranked[0].step_s
    ckpt = tmp_path / "critic"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 1536, '
                                      '"intermediate_size": 8960, "num_hidden_layers": 28, '
                                      '"num_attention_heads": 12, "num_key_value_heads": 2, '
                                      '"vocab_size": 151936, "tie_word_embeddings": true}')
    main(["plan", "--model", "qwen2.5-7b", "--algo", "ppo", "--gpus", "4xH100", "--prompts",
          "64", "--p50", "1024", "--p99", "1024", "--critic", str(ckpt), "--write-plan",
          str(tmp_path / "plan.yaml")])
    capsys.readouterr()
    assert load_config(tmp_path / "plan.yaml").model.critic_path == str(ckpt.resolve())


def test_beside_vllm_a_colocated_generation_copy_is_in_host_memory():
    """A colocated actor trained at ZeRO-3 generates on a copy of its weights. On rlloom's
    engine the copy is on the device, out of generation's budget; beside vLLM it only stages
    the weights vLLM reloads, in host memory (`hosts.staging_device`), and vLLM's own bf16
    weights come out of the budget it is handed (`memory.vllm_kv_bytes`): all of usable
    memory less the trainer's state."""
    from rlloom.perf.model.compose import price, role_models
    from rlloom.plan import Plan
    plan = Plan(placement="colocated", layouts={"actor": Layout(dp=8, zero=3),
                                                "generation": Layout(dp=8)})
    models = role_models(Q7, ("actor", "reference"))
    wl = Workload(64, 8, 512, Lengths("lognormal", 1024, 4096))
    on = {e: price(plan, models, replace(wl, engine=e), H100) for e in ("rlloom", "vllm")}
    held = {e: next(s.transient_bytes for s in p.stages if s.stage == "generation")
            for e, p in on.items()}
    usable = H100.mem_bytes * mem.USABLE - on["vllm"].resident_gib["all"] * 2**30
    copy = 2 * mem.params_per_device(Q7, Layout(dp=8))
    assert held["vllm"] == pytest.approx(usable)
    assert held["rlloom"] <= usable - copy
