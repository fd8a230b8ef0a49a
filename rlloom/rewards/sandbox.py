"""Run untrusted model-written Python against assert-style tests.

Each program runs in a fresh temporary working directory (always removed) through
``_sandbox_harness.py``. What is enforced where:

* host (this module): minimal environment (PATH, HOME=workdir, LANG; never ``os.environ``),
  its own session, a wall-clock timeout, and an output cap: at most ``max_output_bytes`` of
  stdout+stderr are kept, and the run is stopped as soon as the program writes more.
* harness parent (host privileges, runs no untrusted code): ``unshare`` of a new network
  namespace (only a down loopback: no internet, no localhost) and a new pid namespace whose
  pid 1 is the candidate, so all its descendants die with it and are reaped by the kernel.
  Unprivileged hosts try a user namespace for this and run without it if that is refused.
* harness child, before the candidate runs: rlimits (CPU, address space, file size, process
  count, no core dumps); as root it then drops to uid/gid 65534 with no supplementary groups,
  because the kernel does not enforce RLIMIT_NPROC for root. Under that uid the program cannot
  write to root-owned directories, but world-writable ones such as /tmp remain writable at the
  OS level; an audit hook rejects writes outside the workdir and socket connects, as defence
  in depth only (ctypes can bypass it).

Results cannot be forged by the program: each ``assert EXPR == LITERAL`` of the tests is
rewritten (``test_rewrite``) to report EXPR's value as plain builtin data, and the literal stays
in this process, which judges it; the child's report reaches this process through the harness
parent, tagged with a random per-run token that the parent reads only after forking the child,
so it never exists in the program's memory. docs/sandbox.md has the threat model.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from rlloom.rewards.test_rewrite import Expected, judge, rewrite

_HARNESS = Path(__file__).with_name("_sandbox_harness.py")
_SANDBOX_UID = 65534
_FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
_STOP_GRACE_S = 2.0


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_size_mb: int = 1
    max_processes: int = 16
    max_output_bytes: int = 64_000


@dataclass(frozen=True)
class RunResult:
    passed: int
    total: int
    reason: str | None
    output: str = ""  # what the program printed (stdout and stderr), as far as it was kept

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _usable_by_others(path: str) -> bool:
    # The dropped uid is neither owner nor group member, so only the "other" bits count.
    real = Path(os.path.realpath(path))
    if not real.is_file() or real.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH) != (
            stat.S_IROTH | stat.S_IXOTH):
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _interpreter(drop: bool) -> str:
    # After the uid drop the interpreter imports stdlib modules lazily, so all of it must be
    # readable by that uid; a pyenv under /root is not.
    if not drop:
        return sys.executable
    for candidate in (sys.executable, *_FALLBACK_PYTHONS):
        if _usable_by_others(candidate):
            return candidate
    raise RuntimeError("no Python interpreter readable by an unprivileged uid; refusing to run "
                       "untrusted code as root")


def _stop(proc: subprocess.Popen) -> None:
    # SIGTERM lets the harness parent kill the namespace's pid 1 and reap it; SIGKILL to the
    # whole group is the fallback if the harness itself is stuck.
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, str | None]:
    """Reads merged output until EOF; returns (kept output, host-side stop reason or None)."""
    deadline = time.monotonic() + limits.wall_s
    kept = bytearray()
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(kept), "timeout"
            if not sel.select(left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            if len(kept) + len(chunk) > limits.max_output_bytes:
                return bytes(kept), "output limit"
            kept += chunk
    try:
        proc.wait(max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return bytes(kept), "timeout"
    return bytes(kept), None


def _parse(output: bytes, token: str, expected: list[Expected], total: int) -> RunResult:
    """The harness's report and status lines (behind the run's token) judged against the
    expected values (`test_rewrite.judge`); every other line is what the program printed."""
    report, status, printed = None, "harness error", []
    for line in output.decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 2)
        if parts[0] != token or len(parts) < 3:
            printed.append(line)
        elif parts[1] == "report":
            report = _report(parts[2])
        elif parts[1] == "status":
            status = parts[2]
    # the harness writes its lines after a newline of its own
    text = "\n".join(printed).removesuffix("\n")
    if report is None:
        return RunResult(0, total, status if status != "-" else "no result", text)
    reason, completed, reports = report
    passed = sum(judge(expected, total, completed, reports))
    reason = status if status != "-" else reason
    return RunResult(passed, total, None if reason == "-" else reason, text)


def _report(payload: str) -> tuple[str, list[bool], list[tuple[int, Any]]] | None:
    """(reason, completed, reports) of a well-formed report; None otherwise (the candidate
    may have broken the child's writer)."""
    try:
        body = json.loads(payload)
        completed = [c is True for c in body["completed"]]
        reports = [(int(r[0]), r[1]) for r in body["reports"]]
        return str(body["reason"]), completed, reports
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None


def _run_in(workdir: str, code: str, tests: list[str], limits: SandboxLimits) -> RunResult:
    drop = os.geteuid() == 0
    # the expected values of the tests' asserts stay here; the sandbox reports what the
    # program computed (test_rewrite)
    runnable, expected = rewrite(tests)
    Path(workdir, "solution.py").write_text(code, encoding="utf-8")
    Path(workdir, "tests.json").write_text(json.dumps(runnable), encoding="utf-8")
    if drop:
        os.chown(workdir, _SANDBOX_UID, _SANDBOX_UID)
    token = secrets.token_hex(16)
    argv = [_interpreter(drop), "-I", "-S", "-B", str(_HARNESS), workdir,
            *(str(v) for v in (limits.cpu_s, limits.memory_mb, limits.file_size_mb,
                               limits.max_processes, _SANDBOX_UID if drop else -1))]
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=workdir, env=env,
                            start_new_session=True)
    try:
        proc.stdin.write(f"{token}\n".encode())
        proc.stdin.close()
        output, stopped = _collect(proc, limits)
    finally:
        _stop(proc)
        proc.stdout.close()
    if stopped:
        return RunResult(0, len(tests), stopped, output.decode("utf-8", "replace"))
    return _parse(output, token, expected, len(tests))


def run_program(code: str, tests: list[str], limits: SandboxLimits = SandboxLimits()) -> RunResult:
    """Runs ``code`` then each assert in ``tests``; counts the tests that pass."""
    workdir = tempfile.mkdtemp(prefix="rlloom-sandbox-")
    try:
        return _run_in(workdir, code, tests, limits)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class SandboxPool:
    """Runs many programs in parallel; each one is isolated, so none can break the pool."""

    def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="rlloom-sandbox")

    def map(self, programs: list[tuple[str, list[str]]]) -> list[RunResult]:
        return list(self._executor.map(
            lambda program: run_program(program[0], program[1], self.limits), programs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
