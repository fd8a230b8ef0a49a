"""A memory and process budget per sandboxed program, as a cgroup of its own.

rlimits are per process (a program that forks eight 400 MB children uses 3.2 GB under a
512 MB RLIMIT_AS) or per uid; a cgroup counts every process of the program together and is
removed with it. Both cgroup layouts are handled: v1 (a ``memory`` and a ``pids`` hierarchy,
as on this project's CI host) and v2 (one unified hierarchy whose ``cgroup.subtree_control``
must offer ``memory`` and ``pids`` below the caller's cgroup). Boxes are created below the
caller's own cgroup, so a limit set on the trainer still bounds them all.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

_CONTROLLERS = ("memory", "pids")


def _mounts() -> dict[str, Path]:
    """controller ("memory", "pids", or "unified" for v2) -> its mount point."""
    found: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) != 2:
            continue
        mount_point, (fstype, _, options) = line.split()[4], fields[1].split()[:3]
        if fstype == "cgroup2":
            found.setdefault("unified", Path(mount_point))
        elif fstype == "cgroup":
            for c in _CONTROLLERS:
                if c in options.split(","):
                    found[c] = Path(mount_point)
    return found


def _own_paths() -> dict[str, str]:
    """controller -> the caller's cgroup path in that hierarchy ("unified" for v2)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else ["unified"]:
            paths[name] = path.lstrip("/")
    return paths


@functools.cache
def _parents() -> dict[str, Path]:
    """Where box cgroups go: controller -> directory (one "unified" entry for v2). Worked out
    once per process: the judge moves into a cgroup of its own after its first call, and its
    boxes stay siblings of it (cgroup v2 allows no processes in a cgroup with children)."""
    mounts, own = _mounts(), _own_paths()
    if all(c in mounts for c in _CONTROLLERS):
        return {c: mounts[c] / own.get(c, "") for c in _CONTROLLERS}
    if "unified" not in mounts:
        raise OSError("no cgroup hierarchy with the memory and pids controllers is mounted")
    parent = mounts["unified"] / own.get("unified", "")
    control = parent / "cgroup.subtree_control"
    if not set(_CONTROLLERS) <= set(control.read_text().split()):
        control.write_text(" ".join(f"+{c}" for c in _CONTROLLERS))
    return {"unified": parent}


class BoxCgroup:
    """One program's cgroup: created with limits, joined by the box's first process (its
    children inherit it), asked whether the kernel killed for memory, removed after."""

    def __init__(self, memory: Path, pids: Path) -> None:
        self.memory, self.pids = memory, pids  # the same directory on v2

    @classmethod
    def create(cls, name: str, memory_bytes: int, max_pids: int) -> BoxCgroup:
        parents = _parents()
        v2 = "unified" in parents
        box = cls(*(parents["unified" if v2 else c] / name for c in _CONTROLLERS))
        try:
            for d in {box.memory, box.pids}:
                try:
                    d.mkdir()
                except FileExistsError:
                    # left by a judge killed before it removed it: the name holds this
                    # process's pid, which the kernel has reused, so its owner is gone (an
                    # empty cgroup goes with rmdir; one still holding processes fails here)
                    d.rmdir()
                    d.mkdir()
            if v2:
                (box.memory / "memory.max").write_text(str(memory_bytes))
                swap = box.memory / "memory.swap.max"
            else:
                (box.memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                swap = box.memory / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swap: memory.max alone would let a program page out
                swap.write_text(str(0 if v2 else memory_bytes))
            (box.pids / "pids.max").write_text(str(max_pids))
        except OSError:
            box.remove()
            raise
        return box

    def join(self, pid: int) -> None:
        for d in {self.memory, self.pids}:
            (d / "cgroup.procs").write_text(str(pid))

    def oom_killed(self) -> bool:
        for name in ("memory.events", "memory.oom_control"):
            path = self.memory / name
            if path.exists():
                counts = dict(line.split()[:2] for line in path.read_text().splitlines())
                return int(counts.get("oom_kill", 0)) > 0
        return False

    def remove(self) -> None:
        for d in {self.memory, self.pids}:
            _rmdir(d)


def _rmdir(d: Path) -> None:
    # A box's processes were killed with its pid namespace; they leave the cgroup a moment
    # after, and until then rmdir says EBUSY.
    for _ in range(400):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.001)


def remove_left_by(judge_pid: int) -> None:
    """Removes the cgroups of a judge that is gone (its own and its boxes'), which it could
    not remove itself when it was killed."""
    for parent in set(_parents().values()):
        for d in [*parent.glob(f"rlloom-box-{judge_pid}-*"), parent / f"rlloom-judge-{judge_pid}"]:
            _rmdir(d)

