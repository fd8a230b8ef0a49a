"""Experiment trackers, each in its local mode: TensorBoard's event files, W&B's offline run
and MLflow's file store hold every step's numbers and the config; a resumed run drops the
TensorBoard events after its checkpoint; a tracker whose package is missing is refused naming
the extra to install."""
import importlib.util
import json
import shutil

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.runtime.executor.launch import train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)


def _scalars(run, key):
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(key)}, events


def test_tensorboard_gets_the_metrics_and_the_config(tmp_path, tiny):
    run = tmp_path / "run"
    train(load_config(None, [*tiny, "log.trackers=[tensorboard]", f"run_dir={run}"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reward, events = _scalars(run, "reward")
    assert reward == pytest.approx({r["step"]: r["reward"] for r in rows})
    assert {"reward/correct", "kl", "gen_s", "lr"} <= set(events.Tags()["scalars"])
    assert "config" in str(events.Tags()["tensors"])


def test_a_resumed_run_rewrites_the_steps_after_its_checkpoint(tmp_path, tiny):
    """Step 3 was logged but its checkpoint lost (a crash): the resume from step 2 logs it
    again, once."""
    run = tmp_path / "run"
    args = [*tiny, "log.trackers=[tensorboard]", "checkpoint.every=2", "train.steps=3"]
    train(load_config(None, [*args, f"run_dir={run}"]))
    shutil.rmtree(run / "checkpoints" / "step_000003")
    train(load_config(run / "config.yaml", ["train.steps=4"]), resume_dir=run)
    reward, _ = _scalars(run, "reward")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(reward) == [1, 2, 3, 4]
    assert reward == pytest.approx({r["step"]: r["reward"] for r in rows})


def _wandb_history(run):
    """The history rows in W&B's offline run file: a 7-byte W&B header, then a LevelDB log of
    chunks (4-byte checksum, 2-byte length, 1-byte type: 1 whole record, 2-4 its parts)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = run.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, part, rows, config = path.read_bytes(), 7, b"", [], {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.HasField("history"):
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in record.history.item})
            elif record.HasField("run"):
                config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return rows, config


def test_wandb_offline_gets_the_metrics_and_the_config(tmp_path, tiny, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train(load_config(None, [*tiny, "log.trackers=[wandb]", f"run_dir={run}"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    history, config = _wandb_history(run)
    logged = {h["_step"]: h for h in history if "reward" in h}
    assert sorted(logged) == [r["step"] for r in rows]
    for r in rows:
        assert logged[r["step"]]["reward"] == pytest.approx(r["reward"])
        assert logged[r["step"]]["kl"] == pytest.approx(r["kl"])
    assert config["rollout"]["n_samples"] == 4 and config["train"]["steps"] == 3


def test_mlflow_file_store_gets_the_metrics_and_the_config(tmp_path, tiny, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    train(load_config(None, [*tiny, "log.trackers=[mlflow]", "log.project=mine",
                             f"run_dir={run}"]))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    [logged] = client.search_runs([client.get_experiment_by_name("mine").experiment_id])
    rewards = {m.step: m.value for m in client.get_metric_history(logged.info.run_id, "reward")}
    assert rewards == pytest.approx({r["step"]: r["reward"] for r in rows})
    correct = client.get_metric_history(logged.info.run_id, "reward.correct")
    assert [m.value for m in correct] == pytest.approx([r["reward/correct"] for r in rows])
    assert logged.data.params["rollout.n_samples"] == "4"


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_its_extra(name, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *a: None if module == name else real(module, *a))
    with pytest.raises(ConfigError, match=rf"log.trackers has {name}, whose package is not "
                                          rf"installed: pip install 'rlloom\[{name}\]'"):
        load_config(None, [f"log.trackers=[{name}]"])
