"""Groups of several ranks on Ray (gloo on CPU, float64): each layout's run equals the
single-process run step for step, and a killed rank of a group is named by group and rank and
the run resumes from its sharded checkpoint with the uninterrupted run's numbers."""
import json

import pytest
from same_as_one_process import EXACT, assert_same, rows

from rlloom.cli import main

ray = pytest.importorskip("ray")

DISAGGREGATED = ["plan.placement=disaggregated", "plan.layouts.actor.dp=2",
                 "plan.layouts.actor.zero=3", "plan.layouts.generation.tp=2"]

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The one-process runs the layouts are compared with, one per algorithm and model (each
    run once for the module: several layouts compare with the same run)."""
    runs = {}

    def run(algo, tiny, *extra):
        key = (algo, *extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"single-{algo}")
            main(["train", *tiny, f"algo={algo}", *EXACT, *extra, f"run_dir={out}"])
            runs[key] = rows(out)
        return runs[key]
    return run


def test_disaggregated_zero3_training_and_tp_generation_match_one_process(tmp_path, tiny,
                                                                         single):
    """PPO's actor and critic train on 2 ranks at ZeRO-3 with their shards and optimizer step
    in host memory (`offload`), generation on 2 TP ranks fed by weight sync, the reference on
    its own rank: 5 processes. (GRPO at this layout: the killed-rank test below.)"""
    run = tmp_path / "ray"
    main(["train", *tiny, "algo=ppo", *EXACT, *DISAGGREGATED, f"run_dir={run}",
          "plan.layouts.actor.offload=true", "--worker-timeout", "300"])
    assert_same(single("ppo", tiny), rows(run))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # every step the whole policy reaches each TP rank's half (the tied embedding whole)
    assert all(m["sync_bytes"] > 0 for m in metrics)
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {"generation", "actor", "reference"}
    assert single("ppo", tiny)[-1]["grad_norm"] > 0  # it really trained


@pytest.mark.parametrize("algo, tp", [("grpo", 2), ("ppo", 1)])
def test_context_parallel_training_group_matches_one_process(tmp_path, tiny, single, algo, tp):
    """The actor (and PPO's critic) trains on 2 ranks holding half of every sequence each
    (cp=2), for GRPO each of them split over 2 TP ranks (4 ranks); generation and held-out
    evaluation run on a whole copy resharded after every step."""
    run = tmp_path / "ray"
    main(["train", *tiny, f"algo={algo}", *EXACT, "plan.placement=disaggregated",
          "plan.layouts.actor.cp=2", f"plan.layouts.actor.tp={tp}", "plan.layouts.generation.dp=1",
          f"run_dir={run}", "--worker-timeout", "300"])
    assert_same(single(algo, tiny), rows(run))


@pytest.mark.parametrize("algo, plan", [
    ("grpo", ["plan.placement=disaggregated", "plan.layouts.actor.dp=2",
              "plan.layouts.actor.zero=3", "plan.layouts.generation.dp=1"]),
    ("ppo", ["plan.placement=disaggregated", "plan.layouts.actor.tp=2",
             "plan.layouts.generation.dp=1"]),
    ("ppo", ["plan.placement=colocated", "plan.layouts.generation.tp=2"]),
    ("grpo", ["plan.placement=disaggregated", "plan.layouts.actor.cp=2",
              "plan.layouts.generation.dp=1"]),
])
def test_pipeline_parallel_training_group_matches_one_process(tmp_path, tiny, single, algo,
                                                              plan):
    """The actor trains on 2 pipeline stages (one layer each, the tied embedding on both
    ends, 1F1B per micro-batch): for GRPO in 2 data-parallel replicas sharded at ZeRO-3 (4
    ranks); PPO's separate critic is pipelined too, beside the actor, each stage split over
    2 TP ranks (4 ranks), and colocated its stages also score the values, while generation
    runs on a TP copy of the same 2 ranks; GRPO's stages also each over 2 cp ranks holding
    half of every sequence (4 ranks).
    (Without a generation layout each pipeline rank would sample its own prompts as a
    data-parallel replica, with its own stream: valid, but not the one process's samples.)"""
    run = tmp_path / "ray"
    main(["train", *tiny, f"algo={algo}", *EXACT, "plan.layouts.actor.pp=2", *plan,
          f"run_dir={run}", "--worker-timeout", "300"])
    assert_same(single(algo, tiny), rows(run))


@pytest.mark.parametrize("algo, plan", [
    ("ppo", ["plan.placement=disaggregated", "plan.layouts.reference.pp=2"]),
    ("ppo", ["plan.placement=disaggregated", "plan.layouts.reference.cp=2"]),
    ("grpo", ["plan.placement=colocated", "plan.layouts.actor.dp=2",
              "plan.layouts.reference.pp=2", "plan.layouts.generation.tp=2"]),
])
def test_pipelined_reference_matches_one_process(tmp_path, tiny, single, algo, plan):
    """The frozen reference scores on 2 pipeline stages (a forward-only schedule, one layer
    each, log-probs broadcast from the last stage to both): on a group of its own, beside
    PPO's critic copy in the same 2 stages (each stage takes its layers from the whole
    weights weight sync sends after every step), and colocated on the 2 ranks where the
    actor trains at dp2 and generates on a tp2 copy; or on 2 ranks holding half of every
    sequence each (cp=2), the critic copy too."""
    run = tmp_path / "ray"
    main(["train", *tiny, f"algo={algo}", *EXACT, *plan, f"run_dir={run}",
          "--worker-timeout", "300"])
    assert_same(single(algo, tiny), rows(run))


def test_reference_beside_the_actor_in_a_disaggregated_plan_matches_one_process(tmp_path,
                                                                              tiny, single):
    """plan.reference=with_actor: generation on 2 TP ranks of its own, the trainer's 2 ranks
    hold the actor (ZeRO-3), PPO's critic and the reference (dp2) and score there, so the
    critic is read live, with no copy to sync."""
    run = tmp_path / "ray"
    main(["train", *tiny, "algo=ppo", *EXACT, "plan.placement=disaggregated",
          "plan.reference=with_actor", "plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3",
          "plan.layouts.reference.dp=2", "plan.layouts.generation.tp=2", f"run_dir={run}",
          "--worker-timeout", "300"])
    assert_same(single("ppo", tiny), rows(run))
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {"generation", "actor"}


@pytest.mark.parametrize("algo, zero, dp, split", [("grpo", 3, 4, "tp=1"), ("ppo", 1, 2, "cp=2"),
                                                  ("grpo", 2, 2, "tp=2"), ("ppo", 2, 2, "pp=2")])
def test_expert_parallel_training_group_matches_one_process(tmp_path, tiny, single, algo, zero,
                                                            dp, split):
    """A built-in MoE model (4 routed experts, top 2, in every layer) trains on ranks that
    each own 2 experts (ep = 2, tokens exchanged by all-to-all in every MoE layer), the rest
    sharded by ZeRO: for GRPO on 4 ranks (two expert groups of 2, each expert's gradient
    summed over its 2 owners); for PPO on dp2 x cp2 at ZeRO-1 (each rank steps its own
    experts, which route the tokens of its sequence shard), its critic expert-parallel too;
    for GRPO on dp2 x tp2, each expert's features split over the tp ranks of its owner; for
    PPO in 2 pipeline stages of dp2, each stage's experts spread over its dp ranks.
    Generation, on its own rank, gets every expert by weight sync."""
    run = tmp_path / "ray"
    main(["train", *tiny, f"algo={algo}", *EXACT, "model.family=qwen3_moe",
          "plan.placement=disaggregated", f"plan.layouts.actor.dp={dp}",
          f"plan.layouts.actor.{split}", "plan.layouts.actor.ep=2",
          f"plan.layouts.actor.zero={zero}", "plan.layouts.generation.dp=1", f"run_dir={run}",
          "--worker-timeout", "300"])
    assert_same(single(algo, tiny, "model.family=qwen3_moe"), rows(run))


def test_colocated_hybrid_layout_matches_one_process(tmp_path, tiny, single):
    """One group of 2 ranks: the actor trains data-parallel at ZeRO-2 and generates on a TP
    copy resharded after every step; the plan needs 2 devices, so `rlloom train` runs it on
    Ray without being asked."""
    run = tmp_path / "ray"
    main(["train", *tiny, "algo=grpo", *EXACT, "plan.layouts.actor.dp=2",
          "plan.layouts.actor.zero=2", "plan.layouts.generation.tp=2", f"run_dir={run}",
          "--worker-timeout", "300"])
    assert_same(single("grpo", tiny), rows(run))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reshard_bytes"] > 0 and m["sync_bytes"] == 0 for m in metrics)


@pytest.mark.parametrize("algo, plan", [
    ("ppo", ["plan.actor_critic=shared", "plan.layouts.actor.dp=2",
             "plan.layouts.generation.tp=2"]),
    ("ppo", ["plan.actor_critic=shared", "plan.layouts.actor.pp=2",
             "plan.layouts.generation.tp=2"]),
    ("dapo", ["plan.placement=disaggregated", "plan.layouts.generation.tp=2",
              "plan.layouts.generation.dp=2", "train.prompts_per_step=4", "rollout.stop=['1']"]),
])
def test_shared_actor_critic_and_dynamic_sampling_run_in_groups(tmp_path, tiny, single, algo,
                                                                plan):
    """PPO with the value head on a data-parallel actor, and on 2 pipeline stages (the last
    appending the value to the logits), equals one process; DAPO's dynamic
    sampling with 2 TP x 2 DP generation ranks refills whole-batch rounds on every rank alike
    (its replicas sample their own streams, so it runs, and is not compared), its TP copies
    ending responses at a stop string."""
    run = tmp_path / "ray"
    main(["train", *tiny, f"algo={algo}", *EXACT, *plan, f"run_dir={run}",
          "--worker-timeout", "300"])
    got = rows(run)
    if algo == "ppo":
        assert_same(single("ppo", tiny, "plan.actor_critic=shared"), got)
    else:
        assert [r["step"] for r in got] == [1, 2, 3]
        assert all(r["sample_rounds"] >= 1 and r["grad_norm"] > 0 for r in got)


@pytest.mark.parametrize("group, layout", [
    ("actor", ["plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3",
               "plan.layouts.generation.dp=1"]),
    ("generation", ["plan.layouts.generation.dp=2"]),
    ("actor", ["plan.layouts.generation.dp=1", "plan.layouts.actor.pp=2"]),
    ("actor", ["plan.layouts.generation.dp=1", "model.family=qwen3_moe", "plan.layouts.actor.dp=2",
               "plan.layouts.actor.ep=2", "plan.layouts.actor.zero=3"]),
])
def test_a_killed_rank_resumes_as_if_uninterrupted(tmp_path, tiny, single, monkeypatch, capsys,
                                                   group, layout):
    """Rank 1 of a group is killed (SIGKILL) during step 2: the driver names it by group and
    rank, records the failure, and the run resumes from its step-1 sharded checkpoint with
    the numbers of an uninterrupted run. The groups: a dp2 ZeRO-3 training group (DCP shards
    of the 2 ranks); two generation replicas (each samples its own RNG stream, and the
    checkpoint holds both); pipeline stages and expert shards (each holds its own weights and
    AdamW state, kept apart in the sharded checkpoint: a param group keyed by its index would
    make one rank load the other's). A layout that equals one process is compared with it;
    two generation replicas sample differently, so with their own uninterrupted run."""
    plan = ["algo=grpo", *EXACT, "plan.placement=disaggregated", *layout]
    if group == "generation":
        main(["train", *tiny, *plan, f"run_dir={tmp_path / 'whole'}", "--worker-timeout", "120"])
        expected = rows(tmp_path / "whole")
    elif "model.family=qwen3_moe" in layout:
        expected = single("grpo", tiny, "model.family=qwen3_moe")
    else:
        expected = single("grpo", tiny)
    monkeypatch.setenv("RLLOOM_RAY_FAULT", f"kill:{group}/1:2")
    run = tmp_path / "killed"
    main(["train", *tiny, *plan, f"run_dir={run}", "--worker-timeout", "120",
          "--max-restarts", "1"])
    assert f"worker rank 1 of group '{group}'" in capsys.readouterr().out
    [failure] = [json.loads(line) for line in (run / "failures.jsonl").read_text().splitlines()]
    assert failure["rank"] == 1 and failure["step"] == 2 and failure["detected_after_s"] < 120
    print(f"kill of {group} rank 1 detected after {failure['detected_after_s']:.2f}s")
    assert (run / "checkpoints" / "step_000003").is_dir()
    assert_same(expected, rows(run))
