"""Faults injected into real runs of the tiny model, each asserting what the user sees and what
is left on disk: a run is either right or stops clearly, losing nothing."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess

import pytest
import torch
from interrupt import signal_after_two_steps
from safetensors.torch import load_file

from rlloom.cli import main
from rlloom.runtime.executor import corrections
from rlloom.runtime.run_dir import RunDirLock
from rlloom.runtime.stages import online


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _poison_gradients_from(monkeypatch, call: int) -> None:
    """From the `call`-th mini-batch backward on (4 per step: 2 epochs x 2 mini-batches), one
    gradient entry is NaN, as a diverged loss would make it."""
    calls = []
    real = online.policy_backward

    def poisoned(policy, *args, **kwargs):
        stats = real(policy, *args, **kwargs)
        calls.append(1)
        if len(calls) >= call:
            next(p for p in policy.parameters() if p.grad is not None).grad.view(-1)[0] = \
                float("nan")
        return stats

    monkeypatch.setattr(online, "policy_backward", poisoned)


def _weights(path):
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("value, message", [
    ("inf", "train.lr: Input should be a finite number"),
    ("1e30", "train.lr: Input should be less than or equal to 1"),
    ("0", "train.lr: Input should be greater than 0"),
    ("nan", "train.lr: Input should be a finite number"),
])
def test_absurd_learning_rates_are_refused_before_anything_runs(tmp_path, tiny, capsys, value,
                                                                 message):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny, f"train.lr={value}", f"run_dir={run}"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not run.exists()


def test_a_nonfinite_gradient_stops_the_run_and_keeps_the_last_good_checkpoint(
        tmp_path, tiny, capsys, monkeypatch):
    _poison_gradients_from(monkeypatch, 5)  # step 2's first mini-batch
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny, "checkpoint.keep=1", f"run_dir={run}"])
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "step 2: the policy loss or gradient norm is not finite" in err
    assert f"the last checkpoint is {run}/checkpoints/step_000001" in err
    assert f"rlloom train --resume {run}" in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert not (run / "final").exists()
    assert [r["step"] for r in _rows(run)] == [1]
    state = torch.load(run / "checkpoints/step_000001/state.pt", weights_only=False)
    assert all(t.isfinite().all() for t in state["policy"].values())


def test_skip_drops_nonfinite_updates_and_counts_them(tmp_path, tiny, monkeypatch):
    _poison_gradients_from(monkeypatch, 5)  # every update from step 2 on
    run = tmp_path / "run"
    main(["train", *tiny, "train.on_nonfinite=skip", "checkpoint.keep=3", f"run_dir={run}"])
    rows = _rows(run)
    assert [r.get("nonfinite_skips", 0) for r in rows] == [0, 4, 4]
    after_step_1 = torch.load(run / "checkpoints/step_000001/state.pt",
                              weights_only=False)["policy"]
    final = _weights(run / "final")
    assert all(t.isfinite().all() for t in final.values())
    # nothing was applied after step 1: the final weights are step 1's
    for name, value in after_step_1.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=0)


@pytest.fixture
def finished(tmp_path, tiny):
    """A finished 3-step run (a checkpoint every step, the last 2 kept)."""
    run = tmp_path / "run"
    main(["train", *tiny, "checkpoint.keep=2", f"run_dir={run}"])
    return run


def _refused(args, capsys, *messages):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for message in messages:
        assert message in err, err
    return err


def test_a_second_run_into_a_locked_run_dir_is_refused(finished, tiny, capsys):
    holder = RunDirLock(finished)
    try:
        _refused(["train", "--resume", str(finished), "train.steps=4"], capsys,
                 f"{finished} is in use by another run (pid {os.getpid()} on host "
                 f"{socket.gethostname()} since")
    finally:
        holder.release()
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3]


def test_a_new_run_into_a_used_run_dir_is_refused_unless_overwrite(finished, tiny, capsys):
    before = (finished / "metrics.jsonl").read_bytes()
    _refused(["train", *tiny, f"run_dir={finished}"], capsys,
             f"run_dir {finished} already holds files (checkpoints, config.yaml",
             f"rlloom train --resume {finished}", "--overwrite")
    assert (finished / "metrics.jsonl").read_bytes() == before
    main(["train", *tiny, "train.steps=1", f"run_dir={finished}", "--overwrite"])
    assert [r["step"] for r in _rows(finished)] == [1]
    assert [p.name for p in (finished / "checkpoints").iterdir()] == ["step_000001"]


def test_a_resume_override_that_cannot_apply_is_refused_before_anything_is_written(
        finished, capsys):
    before = (finished / "config.yaml").read_bytes()
    _refused(["train", "--resume", str(finished), "algo.kl_coef=0.05", "train.steps=4"],
             capsys, "--resume cannot change algo.kl_coef", "train.lr")
    assert (finished / "config.yaml").read_bytes() == before
    assert not (finished / "resumes.jsonl").exists()


def test_resume_overrides_that_apply_are_applied_and_recorded(finished, capsys):
    (finished / "checkpoints" / ".tmp_crashed").mkdir()  # a checkpoint a kill left half-written
    main(["train", "--resume", str(finished), "train.steps=5", "train.lr=1e-5"])
    out = capsys.readouterr().out
    assert "resumed with train.lr 5e-05 -> 1e-05, train.steps 3 -> 5" in out
    assert "removing" in out and not (finished / "checkpoints" / ".tmp_crashed").exists()
    rows = _rows(finished)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows[3:]] == [1e-5, 1e-5]
    assert "lr: 1.0e-05" in (finished / "config.yaml").read_text()
    assert json.loads((finished / "resumes.jsonl").read_text()) == {
        "step": 3, "changes": {"train.lr": [5e-05, 1e-05], "train.steps": [3, 5]}}


def test_resume_without_a_complete_checkpoint_stops(finished, capsys):
    shutil.rmtree(finished / "checkpoints")
    _refused(["train", "--resume", str(finished), "train.steps=4"], capsys,
             f"--resume {finished}: no complete checkpoint", "--overwrite")


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why", [
    (_flip_a_byte, "state.pt does not match its checksum"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "state.pt has 1000 bytes, the manifest"),
    (lambda p: p.with_name("manifest.json").unlink(), "it has no manifest.json"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one(finished, capsys, damage, why):
    damage(finished / "checkpoints/step_000003/state.pt")
    main(["train", "--resume", str(finished), "train.steps=4"])
    out = capsys.readouterr().out
    assert f"checkpoint {finished}/checkpoints/step_000003 is damaged: {why}" in out
    assert "resuming" in out and "at step 2" in out
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3, 4]
    assert (finished / "checkpoints/.damaged_step_000003").is_dir()
    assert sorted(p.name for p in (finished / "checkpoints").glob("step_*")) == \
        ["step_000003", "step_000004"]


def test_every_checkpoint_damaged_is_a_clear_stop(finished, capsys):
    for step in (2, 3):
        _flip_a_byte(finished / f"checkpoints/step_00000{step}/state.pt")
    _refused(["train", "--resume", str(finished), "train.steps=4"], capsys,
             "no intact checkpoint in", "step_000003: state.pt does not match its checksum",
             "step_000002: state.pt does not match")


def test_a_bad_metrics_line_is_reported_and_the_rows_after_it_kept(finished, capsys):
    lines = (finished / "metrics.jsonl").read_text().splitlines()
    lines.insert(1, '{"step": 1.5, "garbled')
    (finished / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    main(["train", "--resume", str(finished), "train.steps=4"])
    assert f"{finished / 'metrics.jsonl'}:2: not a metrics row" in capsys.readouterr().out
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3, 4]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint(tmp_path, tiny, sig, code):
    run = tmp_path / "run"
    status, err = signal_after_two_steps(
        [*tiny, "train.steps=300", "checkpoint.every=100", "eval.every=100"], run, sig, 120)
    assert status == code, err
    step = len(_rows(run))
    assert 2 <= step < 300
    name = signal.Signals(sig).name
    assert (f"{name} received: stopped after step {step} of 300, checkpoint written to "
            f"{run}/checkpoints/step_{step:06d}; continue with rlloom train --resume {run}") in err
    assert "Traceback" not in err
    main(["train", "--resume", str(run), f"train.steps={step + 1}"])
    assert [r["step"] for r in _rows(run)] == list(range(1, step + 2))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB filesystem (tmpfs): room for a run's config and metrics, not a checkpoint."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_is_one_clear_line(small_disk, tiny, capsys):
    run = small_disk / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny, f"run_dir={run}"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {run}/checkpoints/") and err.count("\n") == 1
    assert "No space left on device" in err and "MiB free of 0.1 MiB there" in err
    assert not list((run / "checkpoints").glob(".tmp_*"))  # the partial write was removed


def test_a_read_only_run_dir_is_one_clear_line(small_disk, tiny, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(SystemExit) as e:
        main(["train", *tiny, f"run_dir={small_disk / 'run'}"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {small_disk / 'run'}: Read-only file system")


def test_a_prompt_file_that_is_not_utf8_names_the_file_and_line(tmp_path, tiny, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"prompt": "Q:1+1=", "answer": "2"}\n{"prompt": "Q:\xff=", "answer": "3"}\n')
    _refused(["train", *tiny, "data.task=arith", f"data.prompt_file={rows}",
              f"run_dir={tmp_path / 'run'}"], capsys,
             f"{rows}:2: not UTF-8 (byte 0xff at column 15); re-encode the file as UTF-8")


def test_truncated_weights_name_the_file(finished, tiny, capsys):
    weights = finished / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    _refused(["train", *tiny, f"model.path={finished / 'final'}",
              f"run_dir={finished.parent / 'run2'}"], capsys,
             f"{weights} cannot be read", "truncated or damaged")


def test_a_sampler_that_disagrees_with_the_trainer_is_measured_and_corrected(
        tmp_path, tiny, monkeypatch):
    """The trainer's own log-probs are shifted by -0.2 per token against the sampler's (a
    sampler perturbed on purpose): every token's ratio trainer / sampler is e^-0.2, so the
    k1 mismatch is 0.2, the largest ratio e^-0.2, and token TIS weighs each token e^-0.2."""
    real = corrections._trainer_logprobs
    monkeypatch.setattr(corrections, "_trainer_logprobs", lambda *a: real(*a) - 0.2)
    run = tmp_path / "run"
    main(["train", *tiny, "algo.rollout_is=token_tis", f"run_dir={run}"])
    for row in _rows(run):
        assert row["mismatch_k1"] == pytest.approx(0.2, abs=1e-4)
        assert row["mismatch_max_ratio"] == pytest.approx(math.exp(-0.2), abs=1e-4)
        assert row["tis_mean"] == pytest.approx(math.exp(-0.2), abs=1e-4)
        assert row["tis_capped"] == 0.0


def test_the_same_engine_shows_no_mismatch(tmp_path, tiny):
    run = tmp_path / "run"
    main(["train", *tiny, "algo.rollout_is=seq_tis", f"run_dir={run}"])
    for row in _rows(run):
        assert abs(row["mismatch_k1"]) < 1e-5 and row["tis_mean"] == pytest.approx(1, abs=1e-4)


def test_resume_from_a_named_checkpoint(finished, capsys):
    main(["train", "--resume", str(finished / "checkpoints" / "step_000002"), "train.steps=4"])
    out = capsys.readouterr().out
    assert "moved step_000003 aside as .superseded_step_000003: resuming from step 2" in out
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3, 4]
    assert (finished / "checkpoints/.superseded_step_000003").is_dir()
    assert json.loads((finished / "resumes.jsonl").read_text())["step"] == 2


def test_a_model_without_a_tokenizer_or_with_a_larger_one_is_named(finished, tiny, capsys):
    model = finished.parent / "model"
    shutil.copytree(finished / "final", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 50}))
    _refused(["train", *tiny, f"model.path={model}", f"run_dir={finished.parent / 'a'}"],
             capsys, f"the tokenizer in {model} has 98 tokens, more than the model's "
                     "vocab_size 50")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        (model / name).unlink(missing_ok=True)
    _refused(["train", *tiny, f"model.path={model}", f"run_dir={finished.parent / 'b'}"],
             capsys, f"{model} has no tokenizer", "save_pretrained")
