"""Atomic, resumable training checkpoints: written to a temporary directory, then renamed."""
from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlloom.models.hf_io import atomic_dir

_NAME = re.compile(r"^step_(\d{6})$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name))


def checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (0 when there is none)."""
    dirs = checkpoint_dirs(run_dir)
    return int(_NAME.match(dirs[-1].name).group(1)) if dirs else 0


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int,
                    write: Callable[[Path], None] | None = None) -> Path:
    """Write `state` as checkpoints/step_NNNNNN (and whatever `write` puts into the directory
    first: a group's sharded weights); a crash mid-write leaves no such directory."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    with atomic_dir(final, prefix=".tmp_") as tmp:
        if write is not None:
            write(tmp)
        torch.save(state, tmp / "state.pt")
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


# checkpoint keys of a trained model and its optimizer, by part ("actor", "critic")
WHOLE_KEYS = {"actor": ("policy", "optimizer"), "critic": ("critic", "critic_optimizer")}
Parts = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def whole_state(parts: Parts) -> dict[str, Any]:
    """Trained models' and optimizers' state dicts under their checkpoint keys (a process
    that holds them whole; a group of ranks writes DCP shards instead)."""
    state = {}
    for name, (model, optim) in parts.items():
        model_key, optim_key = WHOLE_KEYS[name]
        state[model_key], state[optim_key] = model.state_dict(), optim.state_dict()
    return state


def load_whole_state(parts: Parts, state: dict[str, Any]) -> None:
    for name, (model, optim) in parts.items():
        model_key, optim_key = WHOLE_KEYS[name]
        model.load_state_dict(state[model_key])
        optim.load_state_dict(state[optim_key])


def load_latest(run_dir: Path) -> dict[str, Any] | None:
    """The newest checkpoint's state, on the CPU whatever device saved it (RNG states must be
    CPU tensors; `load_state_dict` copies weights and optimizer state to the model's device)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    return torch.load(dirs[-1] / "state.pt", map_location="cpu", weights_only=False)
