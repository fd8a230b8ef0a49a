"""Atomic, verified, resumable training checkpoints.

Each is written to a temporary directory whose last file is ``manifest.json`` (every file's
size and SHA-256), then renamed into place. Loading verifies the manifest: a damaged newest
checkpoint (bit flips, a truncated file) is reported, moved aside as ``.damaged_step_N`` and
the next older complete one is used, so the run neither loads bad weights nor prunes good
checkpoints in favour of the damaged one."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlloom.models.config import CheckpointError
from rlloom.models.hf_io import atomic_dir
from rlloom.runtime.outputs.files import naming

_NAME = re.compile(r"^step_(\d{6})$")
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(directory)}
    with naming(directory / MANIFEST):
        (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint directory against its manifest, or None."""
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "it has no manifest.json (not a complete checkpoint)"
    except (ValueError, KeyError, TypeError):
        return "its manifest.json is not readable"
    present = {str(p.relative_to(directory)) for p in _files(directory)}
    if missing := sorted(set(listed) - present):
        return f"{missing[0]} is missing"
    for name, meta in listed.items():
        path = directory / name
        if path.stat().st_size != meta["size"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name))


def checkpoint_step(run_dir: Path) -> int:
    """The step of the newest complete checkpoint (0 when there is none)."""
    dirs = checkpoint_dirs(run_dir)
    return int(_NAME.match(dirs[-1].name).group(1)) if dirs else 0


CHECKPOINT_CONFIG = "config.yaml"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int,
                    write: Callable[[Path], None] | None = None) -> Path:
    """Write `state` as checkpoints/step_NNNNNN (and whatever `write` puts into the directory
    first: a group's sharded weights); a crash mid-write leaves no such directory. The
    state's "config" (the run's configuration as YAML) is written beside it as
    CHECKPOINT_CONFIG, which a resume holds the run's config.yaml against."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    state = dict(state)
    config = state.pop("config", None)
    with atomic_dir(final, prefix=".tmp_") as tmp:
        if write is not None:
            write(tmp)
        with naming(final / "state.pt"):
            torch.save(state, tmp / "state.pt")
        if config is not None:
            with naming(final / CHECKPOINT_CONFIG):
                (tmp / CHECKPOINT_CONFIG).write_text(config)
        write_manifest(tmp)  # last: a checkpoint with a manifest is complete
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


def load_latest(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its state, on the CPU whatever device saved it (RNG
    states must be CPU tensors; `load_state_dict` copies weights and optimizer state to the
    model's device). Damaged ones are reported and moved aside; CheckpointError when every
    checkpoint is damaged."""
    dirs = checkpoint_dirs(run_dir)
    problems = []
    for directory in reversed(dirs):
        problem = damage(directory)
        if problem is None:
            try:
                return directory, torch.load(directory / "state.pt", map_location="cpu",
                                             weights_only=False)
            except Exception as e:  # noqa: BLE001 - any unreadable state is damage
                problem = f"state.pt cannot be read ({type(e).__name__}: {e})"
        aside = directory.with_name(f".damaged_{directory.name}")
        shutil.rmtree(aside, ignore_errors=True)
        directory.rename(aside)
        problems.append(f"{directory.name}: {problem}")
        print(f"checkpoint {directory} is damaged: {problem}; moved to {aside.name}, "
              "trying the next older one")
    if problems:
        raise CheckpointError(f"no intact checkpoint in {run_dir / 'checkpoints'} ("
                              f"{'; '.join(problems)}); start the run again with --overwrite")
    return None
