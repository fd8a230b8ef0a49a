"""plan.adapt.dry=false on Ray: a run that finds a better plan checkpoints, rebuilds its
groups at it and continues; from the switch on it equals a run resumed from that checkpoint
at the new plan (float64, gloo)."""
import json
import shutil

import pytest
from same_as_one_process import EXACT, assert_same, rows

from rlloom.cli import main
from rlloom.plan import generation_layout

pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_cluster")


def _without_adapt(got):
    return [{k: v for k, v in r.items() if not k.startswith("adapt_")} for r in got]


def test_a_run_that_switches_plans_equals_the_new_plan_resumed_from_its_checkpoint(
        tmp_path, tiny, capsys):
    # activation checkpointing recomputes every forward: the planner's best plan drops it,
    # so a better plan exists whatever the calibration finds
    run = tmp_path / "adaptive"
    main(["train", *tiny, *EXACT, "algo=grpo", "algo.kl_coef=0", "train.steps=4",
          "plan.layouts.actor.dp=2", "plan.layouts.actor.activation_checkpointing=true",
          "plan.adapt.every=2", "plan.adapt.min_gain=1.0001", "plan.adapt.dry=false",
          "plan.adapt.hardware=h100", "checkpoint.keep=10", f"run_dir={run}",
          "--worker-timeout", "120"])
    out = capsys.readouterr().out
    first, second = map(json.loads, (run / "adapt.jsonl").read_text().splitlines())
    assert first["step"] == 2 and first["switch"] and first["gain"] >= 1.0001
    print(f"switched at step 2 from {first['plan']} to {first['best']} ({first['gain']:.2f}x "
          "predicted)")
    assert "switching to it from this step's checkpoint" in out
    assert "activation_checkpointing: true" not in (run / "config.yaml").read_text()
    # the next decision says what the switch predicted and what the new plan then measured
    after = second["after_switch"]
    assert (after["step"], after["to"], after["predicted_after_s"]) == (
        2, first["best"], first["best_s"])
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert after["measured_after_s"] == pytest.approx(
        (steps[2]["step_s"] + steps[3]["step_s"]) / 2, rel=1e-12)  # steps 3-4, the new plan
    assert "since the switch at step 2 measured" in out
    marks = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"]
             if e["name"] == "adapt"]
    assert marks and marks[0]["args"]["switch"] is True
    # the same run resumed at step 2 with the plan it switched to (its config.yaml now)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("ray"))
    main(["train", "--resume", str(resumed / "checkpoints" / "step_000002"),
          "--worker-timeout", "120"])
    last = json.loads((resumed / "adapt.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and not last["switch"]  # nothing left to switch for
    switched, again = _without_adapt(rows(run)), _without_adapt(rows(resumed))
    assert [r["step"] for r in switched] == [1, 2, 3, 4]
    assert_same(switched[2:], again[2:])


def test_a_switch_between_exact_plans_equals_never_switching(tmp_path, tiny, monkeypatch,
                                                             capsys):
    """Both plans colocated, sync and sampling on one replica (each such plan equals one
    process): the run that switches at step 2 ends with the numbers of the run that never
    did. The decision is held to those plans here; what the planner prefers is not the
    point."""
    import rlloom.runtime.executor.adapt as adapt
    real = adapt.advise

    def one_stream(p):
        """Colocated, sync, and sampling on one replica (replicas sample their own streams,
        so a plan of several does not equal one process)."""
        generation = p.gen_layout or generation_layout(p.plan)
        return (p.plan.placement, p.plan.schedule, generation.dp) == ("colocated", "sync", 1)

    def sync_colocated_only(run, hw, measured_s, tick=lambda: None, keep=lambda p: True,
                            **lengths):
        return real(run, hw, measured_s, tick, lambda p: keep(p) and one_stream(p), **lengths)
    monkeypatch.setattr(adapt, "advise", sync_colocated_only)
    args = [*tiny, *EXACT, "algo=grpo", "algo.kl_coef=0", "train.steps=4",
            "plan.layouts.actor.dp=2", "plan.layouts.actor.activation_checkpointing=true",
            "plan.layouts.generation.tp=2", "--worker-timeout", "120"]
    main(["train", *args[:-2], "plan.adapt.every=2", "plan.adapt.min_gain=1.0001",
          "plan.adapt.dry=false", "plan.adapt.hardware=h100", f"run_dir={tmp_path / 'a'}",
          *args[-2:]])
    first = json.loads((tmp_path / "a" / "adapt.jsonl").read_text().splitlines()[0])
    assert first["switch"] and first["best"].startswith("colocated/sync/")
    print(f"switched at step 2 to {first['best']}")
    main(["train", *args[:-2], f"run_dir={tmp_path / 'b'}", *args[-2:]])
    assert_same(rows(tmp_path / "b"), _without_adapt(rows(tmp_path / "a")))
