"""A run directory belongs to one run: claimed with an exclusive lock for the run's life, never
silently reused by a new run, and resumed only with the changes a resume can honour.

* A new run into a directory that already holds files is refused unless ``--overwrite``
  (which empties it first) or ``--resume``.
* The lock is ``flock`` on ``run_dir/.lock``, held by the driver process: the kernel drops it
  when that process ends, however it ends, so a crash never leaves a stale lock. A second
  run into the directory is refused, naming the holder's pid and host.
* ``--resume`` needs a complete checkpoint, and its overrides are checked against the saved
  config before anything is written: the fields in ``RESUMABLE`` are applied from the next
  step on (and recorded in ``resumes.jsonl``); any other change is refused, because the
  checkpoint carries state built with the old value (an adaptive KL coefficient, the data
  position, the model and optimizer) that the new value would silently not reach. The saved
  config is the one the checkpoint was trained with (``checkpoints/step_N/config.yaml``), so
  a hand-edited ``run_dir/config.yaml`` is held to the same rules as overrides; an empty one
  is refused.
* The data files' contents are fingerprinted (``inputs.json``); a resume against changed
  files is refused, naming them, unless ``--accept-changed-data`` (then recorded).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError, RunConfig, load_config
from rlloom.runtime.checkpoint import CHECKPOINT_CONFIG, checkpoint_dirs
from rlloom.runtime.outputs.files import append_line

LOCK = ".lock"
# dotted prefixes of the fields a resumed run applies from its next step on
RESUMABLE = ("train.steps", "train.lr", "train.grad_clip", "train.on_nonfinite",
             "train.threads", "train.device", "eval.", "checkpoint.", "log.", "plan.",
             "reward.sandbox_workers", "reward.sandbox_isolation", "run_dir")


class RunDirLock:
    """The exclusive claim on a run directory (``release`` or process exit drops it)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            self._fd = None
            raise ConfigError(f"{run_dir} is in use by another run ({holder}); two runs must "
                              "not share a run directory: wait for it, stop it, or choose "
                              "another run_dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim(run_dir: Path, resume: bool, overwrite: bool) -> RunDirLock:
    """Creates (or, for ``--overwrite``, empties) and locks ``run_dir``; refuses a new run
    into a directory that holds files. Removes checkpoint directories a crash left
    half-written."""
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"run_dir {run_dir} already holds files ({_listing(run_dir)}); continue that "
                f"run with rlloom train --resume {run_dir}, choose another run_dir, or pass "
                "--overwrite to replace it")
        lock = RunDirLock(run_dir)  # never empty a directory another run is writing
        for entry in run_dir.iterdir():
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() \
                    else entry.unlink()
        return lock
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir)
    for stale in (run_dir / "checkpoints").glob(".tmp_*"):
        print(f"removing {stale}: a checkpoint a stopped run left half-written")
        shutil.rmtree(stale, ignore_errors=True)
    return lock


def _listing(run_dir: Path) -> str:
    names = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def resume_changes(saved: RunConfig, resumed: RunConfig, run_dir: Path) -> dict[str, list]:
    """field -> [saved, new] of what a ``--resume``'s overrides change; ConfigError, before
    anything is written, when one cannot apply. Also refuses a resume without a complete
    checkpoint."""
    if not checkpoint_dirs(run_dir):
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'}"
                          " (the run stopped before its first one, every checkpoint.every="
                          f"{saved.checkpoint.every} steps); start it again with --overwrite")
    old, new = _flat(saved.model_dump(mode="json")), _flat(resumed.model_dump(mode="json"))
    changes = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)}
    refused = [k for k in changes if not any(k == p or k.startswith(p) for p in RESUMABLE)]
    if refused:
        raise ConfigError(
            f"--resume cannot change {', '.join(refused)}: the checkpoint carries state built "
            "with the saved value, which the new one would not reach. A resume can change "
            f"{', '.join(p.rstrip('.') + ('.*' if p.endswith('.') else '') for p in RESUMABLE)}"
            "; start a new run (another run_dir) to change the rest")
    return changes


def checkpoint_of(path: Path) -> int:
    """The step of a checkpoint directory given to --resume; ConfigError if it is none."""
    if not (path / "state.pt").is_file() or not path.name.startswith("step_"):
        raise ConfigError(f"--resume {path}: not a checkpoint (expected "
                          "RUN_DIR/checkpoints/step_NNNNNN holding state.pt)")
    return int(path.name.removeprefix("step_"))


def rewind(run_dir: Path, step: int) -> None:
    """Moves the checkpoints newer than `step` aside (.superseded_step_N), so the resumed run
    continues from `step` and never prunes it in their favour."""
    for directory in checkpoint_dirs(run_dir):
        if int(directory.name.removeprefix("step_")) > step:
            aside = directory.with_name(f".superseded_{directory.name}")
            shutil.rmtree(aside, ignore_errors=True)
            directory.rename(aside)
            print(f"moved {directory.name} aside as {aside.name}: resuming from step {step}")


def record_resume(run_dir: Path, step: int, changes: dict[str, list]) -> None:
    """Appends what a resume changed to run_dir/resumes.jsonl and says so."""
    append_line(run_dir / "resumes.jsonl", json.dumps({"step": step, "changes": changes}))
    if changes:
        print("resumed with " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))


def saved_config(run_dir: Path, step: int | None) -> RunConfig:
    """The config the checkpoint a resume continues from was trained with (`step`, else the
    newest): its own copy, or for a checkpoint older than those copies, config.yaml."""
    text = (run_dir / "config.yaml").read_text()
    if not text.strip():
        raise ConfigError(f"--resume {run_dir}: config.yaml is empty; copy the checkpoint's own "
                          f"({run_dir}/checkpoints/step_N/{CHECKPOINT_CONFIG}) back to it")
    dirs = [d for d in checkpoint_dirs(run_dir) if step is None or d.name == f"step_{step:06d}"]
    copy = dirs[-1] / CHECKPOINT_CONFIG if dirs else None
    return load_config(copy if copy is not None and copy.is_file() else run_dir / "config.yaml")


INPUT_FIELDS = ("data.prompt_file", "data.eval_file", "data.preference_file")
INPUTS = "inputs.json"


def fingerprints(cfg: RunConfig) -> dict[str, str]:
    """field -> sha256 of the contents of each data file the run reads (a `save_to_disk`
    directory: of its files, by name)."""
    out = {}
    for field in INPUT_FIELDS:
        path = _field(cfg, field)
        if path:
            digest = hashlib.sha256()
            root = Path(path)
            for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
                if f.is_file():
                    digest.update(str(f.relative_to(root)).encode() if root.is_dir() else b"")
                    with open(f, "rb") as data:
                        while chunk := data.read(1 << 20):
                            digest.update(chunk)
            out[field] = digest.hexdigest()
    return out


def changed_inputs(run_dir: Path, saved: RunConfig, cfg: RunConfig) -> dict[str, list]:
    """"field (contents)" -> [old, new] sha256 of the data files whose contents changed since
    the run last started, at the same path (another path is a config change)."""
    recorded = run_dir / INPUTS
    if not recorded.is_file():
        return {}
    old, new = json.loads(recorded.read_text()), fingerprints(cfg)
    same_path = [f for f in INPUT_FIELDS if _field(saved, f) == _field(cfg, f)]
    return {f"{f} (contents)": [old.get(f), new.get(f)] for f in same_path
            if f in old and old.get(f) != new.get(f)}


def _field(cfg: RunConfig, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)
