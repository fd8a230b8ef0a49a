"""Experiment trackers: the rows of metrics.jsonl (the numbers in them) and the run's config,
sent to TensorBoard, Weights & Biases or MLflow as the run goes. Each is an optional extra
(`pip install 'rlloom[tensorboard]'`); metrics.jsonl stays the record a resume relies on."""
from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # -> module


def check_installed(names: list[str]) -> None:
    """Every tracker's package is importable, or a ValueError naming the extra to install."""
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"log.trackers has {name}, whose package is not installed: "
                             f"pip install 'rlloom[{name}]'")


class Tracker(Protocol):
    def log(self, row: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (lists and histograms stay in metrics.jsonl)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
            and math.isfinite(v)}


class _TensorBoard:
    def __init__(self, run_dir: Path, config_text: str, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter
        # a resumed run drops the events logged after its checkpoint, as metrics.jsonl does
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)
        self.writer.add_text("config", f"```\n{config_text}\n```", 0)

    def log(self, row: dict[str, Any], step: int) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        import wandb
        # one W&B run per run directory, continued by a resume
        self.run = wandb.init(project=project, dir=str(run_dir), config=config,
                              name=run_dir.name, id=f"rlloom-{run_dir.name}", resume="allow")

    def log(self, row: dict[str, Any], step: int) -> None:
        self.run.log(scalars(row), step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run_dir: Path, config: dict[str, Any], project: str) -> None:
        import mlflow
        self.mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:  # a local file store in the run
            # MLflow 3 keeps the file store behind this switch (a database needs a server
            # or SQLAlchemy, which the tracking client alone does not bring)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params(_flat(config))

    def log(self, row: dict[str, Any], step: int) -> None:
        # MLflow's file store keeps a metric per file, so "reward" (a file) and
        # "reward/correct" (a file in a directory "reward") cannot both exist: "." joins
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars(row).items()},
                               step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextmanager
def closing_all(trackers: list[Tracker]) -> Iterator[None]:
    """Close every tracker when the block ends, however it ends."""
    try:
        yield
    finally:
        for tracker in trackers:
            tracker.close()


def open_trackers(names: list[str], run_dir: Path, config: dict[str, Any], config_text: str,
                  project: str, first_step: int) -> list[Tracker]:
    check_installed(names)
    made: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            made.append(_TensorBoard(run_dir, config_text, first_step))
        elif name == "wandb":
            made.append(_WandB(run_dir, config, project))
        else:
            made.append(_MLflow(run_dir, config, project))
    return made
