"""Worker faults in the Ray runtime: detected within the timeout with the worker's group,
roles and rank named; with restarts allowed the run resumes from its last checkpoint."""
import json
import math
import shutil
import signal

import pytest
from interrupt import signal_after_two_steps

from rlloom.cli import main

ray = pytest.importorskip("ray")

TIMING = {"gen_s", "assess_s", "train_s", "step_s"}
RAY_ONLY = {"staleness", "staleness_hist", "dropped", "behaviour_kl", "sync_s", "sync_bytes"}
SIGNAL = ["algo.overlong=penalty"]  # spread the tiny model's rewards so the runs train


pytestmark = pytest.mark.usefixtures("ray_cluster")


def _rows(run):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING | RAY_ONLY}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _failures(run):
    return [json.loads(line) for line in (run / "failures.jsonl").read_text().splitlines()]


def test_killed_generation_worker_is_named_and_the_run_resumes(tmp_path, tiny, monkeypatch,
                                                               capsys):
    args = [*tiny, *SIGNAL, "train.steps=3"]  # a checkpoint after every step
    main(["train", *args, f"run_dir={tmp_path / 'single'}"])
    monkeypatch.setenv("RLLOOM_RAY_FAULT", "kill:generation:2")  # SIGKILL it as step 2 runs
    run = tmp_path / "ray"
    main(["train", *args, "plan.placement=disaggregated", f"run_dir={run}",
          "--worker-timeout", "60", "--max-restarts", "1"])
    out = capsys.readouterr().out
    assert "worker rank 0 of group 'generation' on node " in out
    assert "(stages: generation) died" in out
    [failure] = _failures(run)
    assert failure["step"] == 2 and failure["state"] == "died"
    assert failure["detected_after_s"] < 60  # reported by Ray, long before the timeout
    print(f"kill detected after {failure['detected_after_s']:.2f}s")
    # resumed from the step-1 checkpoint: the same numbers as an uninterrupted run
    rows, expected = _rows(run), _rows(tmp_path / "single")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for a, b in zip(expected, rows):
        for key, value in a.items():
            if isinstance(value, float):
                assert math.isclose(value, b[key], rel_tol=1e-6, abs_tol=1e-9), (a["step"], key)
            else:
                assert value == b[key], (a["step"], key)


def test_silent_worker_times_out_then_its_checkpoint_resumes_either_way(tmp_path, tiny,
                                                                       monkeypatch, capsys):
    """An async run whose generation worker stops answering (SIGSTOP) is stopped after the
    timeout with the worker named. Its last checkpoint holds the samples generated ahead for
    the next step; a sync resume finds them one version too stale and generates them again,
    and the single-process runtime resumes the same checkpoint."""
    monkeypatch.setenv("RLLOOM_RAY_FAULT", "stop:generation:3")
    run = tmp_path / "ray"
    args = [*tiny, *SIGNAL, "train.steps=3", "plan.placement=disaggregated"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", *args, "plan.schedule=async", "plan.staleness=1", f"run_dir={run}",
              "--worker-timeout", "4"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "worker rank 0 of group 'generation' on node " in err
    assert "(stages: generation) did not answer a ping" in err
    assert "no answer within 4s" in err and f"--resume {run}" in err
    [failure] = _failures(run)
    assert 4 <= failure["detected_after_s"] < 4 + 10  # the timeout, then a 4 s ping
    print(f"silence detected after {failure['detected_after_s']:.2f}s")
    assert [r["step"] for r in _rows(run)] == [1, 2]
    shutil.copytree(run, tmp_path / "single")

    monkeypatch.delenv("RLLOOM_RAY_FAULT")
    main(["train", "--resume", str(run), "plan.schedule=sync", "plan.staleness=0"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["staleness_hist"], r["dropped"]) for r in rows] == [
        (1, {"0": 16}, 0), (2, {"1": 16}, 0), (3, {"0": 16}, 16)]

    main(["train", "--resume", str(tmp_path / "single"), "plan.placement=colocated",
          "plan.schedule=sync", "plan.staleness=0"])
    assert [r["step"] for r in _rows(tmp_path / "single")] == [1, 2, 3]


def test_a_worker_that_cannot_start_is_not_restarted():
    """A constructor's error is deterministic: it surfaces as itself (a user error prints as
    `error: ...`), not as a fault to restart from."""
    from ray.exceptions import RayActorError

    from rlloom.models.hf_io import CheckpointError
    from rlloom.runtime.executor.ray.cluster import start_error
    text = ("The actor died because of an error raised in its creation task\n  File x\n"
            "rlloom.models.config.CheckpointError: reward model r has a vocabulary of 5")
    err = start_error(RayActorError(None, text, actor_init_failed=True), None)
    assert isinstance(err, CheckpointError) and str(err) == "reward model r has a vocabulary of 5"
    other = start_error(RayActorError(None, "died\nOSError: disk full", True), None)
    assert isinstance(other, RuntimeError) and "failed to start: OSError: disk full" in str(other)


def test_sigterm_on_ray_stops_at_a_step_boundary_and_resumes(tmp_path, tiny):
    """Preemption (SIGTERM to the driver) on the Ray runtime: the step finishes, every group
    is checkpointed, the driver exits 143 naming the step; the run resumes from it."""
    run = tmp_path / "run"
    status, err = signal_after_two_steps(
        [*tiny, "train.steps=200", "checkpoint.every=100", "eval.every=100",
         "plan.placement=disaggregated"], run, signal.SIGTERM, 180)
    assert status == 143, err
    step = len(_rows(run))
    assert f"SIGTERM received: stopped after step {step} of 200" in err
    main(["train", "--resume", str(run), f"train.steps={step + 1}"])
    assert [r["step"] for r in _rows(run)] == list(range(1, step + 2))
