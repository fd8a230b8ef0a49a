"""The Ray runtime: every placement x schedule runs, and a synchronous disaggregated run
matches the single-process runtime."""
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.data.synthetic import generate
from rlloom.runtime.executor.ray.cluster import MAX_TEMP_DIR_CHARS, ray_temp_dir

ray = pytest.importorskip("ray")

TIMING = {"gen_s", "assess_s", "train_s", "step_s"}
SYNC = {"sync_s", "sync_bytes"}  # weights cross processes only on Ray
GROUPS = {"colocated": {"all"}, "interleaved": {"trainable", "frozen"},
          "disaggregated": {"generation", "actor", "reference"}}
# rewards of the under-trained tiny model are all 0; the soft overlong penalty spreads them, so
# advantages, losses and gradients are not zero and the runs really train
SIGNAL = ["algo.overlong=penalty"]


pytestmark = pytest.mark.usefixtures("ray_cluster")


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_run(run: Path, placement: str, schedule: str) -> None:
    """What every placement x schedule run must show: its steps, finite metrics, the staleness
    its schedule implies, weights crossing processes only when generation runs apart, the
    trace's groups and stages, fused chunks, its checkpoint and final model."""
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        for key in ["reward", "loss", "kl", "clip_frac", "entropy", "gen_s", "assess_s",
                    "train_s", "behaviour_kl", "sync_s"]:
            assert math.isfinite(r[key]), key
        assert sum(r["staleness_hist"].values()) == 16 and r["dropped"] == 0
        assert (r["sync_bytes"] > 0) == (placement == "disaggregated")
    # step 2 of an async run was generated while step 1 trained: one version behind
    assert rows[1]["staleness_hist"] == ({"1": 16} if schedule == "async" else {"0": 16})
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == GROUPS[placement]
    assert {"generation", "assessment", "training", "eval"} <= {e["name"] for e in trace}
    assert {e["args"]["step"] for e in trace if e["name"] == "training"} == {
        r["step"] for r in rows}
    if schedule == "fused":  # two chunks generated and assessed, then merged, per step
        chunks = [e for e in trace if e["name"] == "assessment" and e["args"]["step"] == 2]
        assert sorted(str(e["args"]["chunk"]) for e in chunks) == ["0", "1", "merge"]
    assert (run / "checkpoints" / f"step_{len(rows):06d}" / "state.pt").is_file()
    assert (run / "final" / "config.json").is_file()


# colocated/fused and colocated/async: test_one_process_runs_every_schedule_...; and
# disaggregated/sync: test_disaggregated_sync_matches_single_process (same checks, and more)
@pytest.mark.parametrize("placement, schedule", [
    ("colocated", "sync"), ("interleaved", "sync"), ("interleaved", "fused"),
    ("interleaved", "async"), ("disaggregated", "fused"), ("disaggregated", "async")])
def test_placement_and_schedule_run(tmp_path, tiny, placement, schedule):
    run = tmp_path / "run"
    plan = [f"plan.placement={placement}", f"plan.schedule={schedule}"]
    if schedule == "async":
        plan.append("plan.staleness=1")
    main(["train", *tiny, *SIGNAL, *plan, "train.steps=2", f"run_dir={run}", "--ray",
          "--worker-timeout", "120"])
    _check_run(run, placement, schedule)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_disaggregated_sync_matches_single_process(tmp_path, tiny, algo):
    """Same loaders, seeds and stage functions: the same numbers. Measured: identical
    (difference 0); asserted to 1e-6 relative."""
    args = [*tiny, f"algo={algo}", *SIGNAL, "train.steps=3"]  # algo=NAME first: it resets algo
    main(["train", *args, f"run_dir={tmp_path / 'single'}"])
    main(["train", *args, "plan.placement=disaggregated", f"run_dir={tmp_path / 'ray'}",
          "--worker-timeout", "120"])
    single, distributed = _rows(tmp_path / "single"), _rows(tmp_path / "ray")
    assert len(single) == len(distributed) == 3
    for a, b in zip(single, distributed):
        assert set(b) == set(a)
        for key, value in a.items():
            if key in TIMING | SYNC:
                continue
            if isinstance(value, float):
                assert math.isclose(value, b[key], rel_tol=1e-6, abs_tol=1e-9), (a["step"], key)
            else:
                assert value == b[key], (a["step"], key)
    assert single[-1]["grad_norm"] > 0 and single[-1]["kl"] != 0  # it really trained
    _check_run(tmp_path / "ray", "disaggregated", "sync")


@pytest.mark.parametrize("schedule", ["fused", "async"])
def test_one_process_runs_every_schedule_as_a_one_rank_ray_group_does(tmp_path, tiny, schedule):
    """One step loop: a colocated plan under the fused or async schedule runs in this process
    (no Ray) with the same calls, in the same order, as on a one-rank Ray group, so the metrics
    are identical; async with staleness 1 really trains a version behind, with the decoupled
    correction."""
    args = [*tiny, "algo=ppo", *SIGNAL, "train.steps=3", f"plan.schedule={schedule}"]
    if schedule == "async":
        args.append("plan.staleness=1")
    main(["train", *args, f"run_dir={tmp_path / 'single'}"])
    main(["train", *args, f"run_dir={tmp_path / 'ray'}", "--ray", "--worker-timeout", "120"])
    single, on_ray = _rows(tmp_path / "single"), _rows(tmp_path / "ray")
    assert len(single) == len(on_ray) == 3
    for a, b in zip(single, on_ray):
        assert set(a) == set(b)
        for key in set(a) - TIMING - SYNC:
            assert a[key] == b[key], (a["step"], key)
    lag = "1" if schedule == "async" else "0"
    assert [r["staleness_hist"] for r in single] == [{"0": 16}, {lag: 16}, {lag: 16}]
    if schedule == "async":  # behaviour and proximal policies differ once samples are stale
        # (step 1 is on-policy: only float32 sampling log-probs against the recomputed ones)
        assert abs(single[0]["behaviour_kl"]) < 1e-6 < abs(single[1]["behaviour_kl"])
    _check_run(tmp_path / "ray", "colocated", schedule)
    trace = json.loads((tmp_path / "single" / "trace.json").read_text())["traceEvents"]
    if schedule == "fused":
        chunks = [e for e in trace if e["name"] == "assessment" and e["args"]["step"] == 2]
        assert sorted(str(e["args"]["chunk"]) for e in chunks) == ["0", "1", "merge"]


def test_dpo_on_a_ray_group_equals_one_process(tmp_path, tiny):
    """Offline training runs through the same step loop on Ray (a colocated one-rank group)
    as in one process, with the same numbers; another placement is refused before start."""
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for p in generate("arith", 40, seed=3, difficulty=1):
            wrong = str(int(p.answer) + 1)
            f.write(json.dumps({"prompt": p.prompt, "chosen": p.solution, "rejected":
                                p.solution.replace(f"A:{p.answer}", f"A:{wrong}")}) + "\n")
    args = [*tiny, "algo=dpo", f"data.preference_file={pairs}", "train.lr=1e-3"]
    main(["train", *args, f"run_dir={tmp_path / 'single'}"])
    main(["train", *args, f"run_dir={tmp_path / 'ray'}", "--ray", "--worker-timeout", "120"])
    single, on_ray = _rows(tmp_path / "single"), _rows(tmp_path / "ray")
    assert [r["step"] for r in on_ray] == [1, 2, 3] and single[-1]["margin"] > 0
    for a, b in zip(single, on_ray):
        for key in set(a) - TIMING:
            assert a[key] == b[key], (a["step"], key)
    with pytest.raises(SystemExit):
        main(["train", *args, "plan.placement=disaggregated", f"run_dir={tmp_path / 'd'}"])


def test_layouts_the_executor_does_not_run_are_refused_before_start(tmp_path, tiny, capsys):
    with pytest.raises(SystemExit):
        main(["train", *tiny, "plan.placement=disaggregated", "plan.layouts.generation.pp=2",
              "plan.layouts.actor.ep=2", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "plan.layouts.generation.pp=2: pipeline stages (with tp and cp or not) run the" in err
    assert "plan.layouts.actor.ep=2: the executor spreads the experts" in err
    assert "--price-only" in err
    assert not (tmp_path / "run").exists()


def test_a_cluster_too_small_for_the_groups_is_refused_at_once(tmp_path, tiny, capsys):
    with pytest.raises(SystemExit):  # 8 + 1 + 1 ranks of one CPU on a 8-CPU cluster
        main(["train", *tiny, "plan.placement=disaggregated", "plan.layouts.generation.dp=8",
              "train.prompts_per_step=8", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "need 10 CPUs" in err and "generation: 8 ranks" in err and "has 8 CPUs" in err


def test_long_run_dir_gets_a_short_ray_temp_dir(tmp_path):
    short_run = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    assert ray_temp_dir(short_run) == (short_run / "ray", None)  # Ray's files in the run
    shutil.rmtree(short_run)
    long_run = tmp_path / ("x" * 80)
    long_run.mkdir()
    temp, note = ray_temp_dir(long_run)
    assert len(str(temp)) <= MAX_TEMP_DIR_CHARS and "too long" in note
    assert (long_run / "ray").resolve() == temp.resolve()  # reachable from the run dir
    shutil.rmtree(temp)
