"""Experiment trackers: TensorBoard's event files hold every step's numbers and the config, a
resumed run drops the events after its checkpoint, and a tracker whose package is missing is
refused naming the extra to install."""
import importlib.util
import json
import shutil

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.runtime.executor.trainer import train

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


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_names_its_extra(name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(ConfigError, match=rf"log.trackers has {name}, whose package is not "
                                          rf"installed: pip install 'rlloom\[{name}\]'"):
        load_config(None, [f"log.trackers=[{name}]"])
