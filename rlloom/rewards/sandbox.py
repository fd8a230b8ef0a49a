"""Run untrusted model-written Python against tests: the public face of the sandbox.

Three processes per program, none trusting the next: this one (the trainer) hands jobs to
judge processes (``judge.py``), each judge runs the tests in its own memory and starts one
isolated box per program (``box.py``), and only the program runs in the box. Two test formats:

* assert tests, ``["assert add(2, 3) == 5", ...]`` (HumanEval / MBPP style): any assert shape;
* stdin/stdout cases, ``[{"input": "2 3\\n", "output": "5\\n"}, ...]`` (APPS, TACO,
  CodeContests, LiveCodeBench style): the whole program once per case, its output compared
  by ``io_compare`` (``exact`` lines, whitespace ``tokens``, or ``float`` within ``float_tol``).

``isolation`` says what the box must have (``box.py``): ``strict`` (default: namespaces and a
per-program cgroup), ``namespaces`` (no cgroups: memory and processes bounded per process and
per uid), ``process`` (rlimits only, for trusted code). When the machine cannot give what
was asked, the pool refuses to score anything (``SandboxUnavailable``, naming the fix).
docs/sandbox.md has the threat model and the tests that show each barrier.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from types import TracebackType
from typing import Union

from rlloom.rewards import box_files, cgroups
from rlloom.rewards.box import ISOLATIONS, SandboxLimits
from rlloom.rewards.judge import job

Tests = Union[list[str], list[dict]]
IO_COMPARES = ("exact", "tokens", "float")
_JUDGE_SLACK_S = 5.0  # a judge's own work on top of its box's wall budget
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

_FIXES = {
    "strict": "set reward.sandbox_isolation=namespaces to bound memory and processes per "
              "process and per uid instead of per program, or give rlloom a cgroup it can "
              "write (root with cgroup v1 memory+pids, or a cgroup v2 subtree delegated with "
              "memory and pids)",
    "namespaces": "run as root, or allow unprivileged user namespaces (sysctl "
                  "kernel.unprivileged_userns_clone=1 / user.max_user_namespaces), or set "
                  "reward.sandbox_isolation=process to run programs with rlimits only (trusted "
                  "programs only: nothing then stops them reading your files)",
    "process": "check that the interpreter and /tmp are usable",
}


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate programs as the configuration asks."""


@dataclass(frozen=True)
class RunResult:
    passed: int
    total: int
    reason: str | None
    output: str = ""  # what the program printed outside its tests' stdout, as far as kept

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass(frozen=True)
class ScriptResult:
    stdout: str
    stderr: str
    exit: int | None
    reason: str | None


def _kind(tests: Tests) -> str:
    if all(isinstance(t, str) for t in tests):
        return "asserts"
    if all(isinstance(t, dict) and isinstance(t.get("input"), str)
           and isinstance(t.get("output"), str) for t in tests):
        return "io"
    raise ValueError("tests must be all assert strings or all {'input': str, 'output': str}")


class _Judge:
    """One judge process; replaced when it hangs or dies."""

    def __init__(self, isolation: str) -> None:
        self.isolation = isolation
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": _PACKAGE_ROOT,
               "LANG": "C.UTF-8"}
        # what boxes see is found (and warmed) once per process, not once per judge
        visible = [] if isolation == "process" else [box_files.for_boxes().to_json()]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlloom.rewards.judge", isolation, *visible],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)

    def run(self, line: dict, timeout_s: float) -> dict | None:
        """The judge's answer to one job, or None when it hung or died (it is then killed)."""
        try:
            self.proc.stdin.write(json.dumps(line).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.kill()
            return None
        deadline, got = time.monotonic() + timeout_s, bytearray()
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not got.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.kill()
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    self.kill()
                    return None
                got += chunk
        return json.loads(got)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, wait_s: float = 0.0) -> None:
        """Ends the judge: given ``wait_s``, it first closes its boxes itself; then nothing
        of it is left (its boxes die with it, and a strict judge's cgroups are removed)."""
        if wait_s and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(wait_s)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except BrokenPipeError:
                pass
        if self.isolation == "strict":
            cgroups.remove_left_by(self.proc.pid)


class SandboxPool:
    """Judges ``workers`` programs at a time; each program in a box of its own."""

    def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits(),
                 isolation: str = "strict", io_compare: str = "tokens",
                 float_tol: float = 1e-6) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, not {isolation!r}")
        if io_compare not in IO_COMPARES:
            raise ValueError(f"io_compare must be one of {IO_COMPARES}, not {io_compare!r}")
        self.limits, self.isolation = limits, isolation
        self.io_compare, self.float_tol = io_compare, float_tol
        self._judges: SimpleQueue[_Judge | None] = SimpleQueue()
        for _ in range(workers):
            self._judges.put(None)  # started on first use
        self._workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="rlloom-sandbox")
        self._check()

    def _check(self) -> None:
        """Refuses up front when this machine cannot give the isolation asked for."""
        probe = self._judged(job("asserts", "x = 1", self.limits, tests=["assert x == 1"]))
        if probe.get("passed") != 1:
            raise SandboxUnavailable(f"the code sandbox's self-check failed ({probe['reason']})"
                                     f"; {_FIXES[self.isolation]}")

    def _submit(self, line: dict) -> dict:
        judge = self._judges.get()
        try:
            if judge is None or not judge.alive():
                try:
                    judge = _Judge(self.isolation)
                except OSError as e:  # what boxes would see could not be found
                    judge = None
                    return {"unavailable": str(e)}
            result = judge.run(line, self.limits.wall_s + _JUDGE_SLACK_S)
            if result is None:
                judge = None
                result = {"passed": 0, "total": len(line.get("tests", [])),
                          "reason": "judge timeout", "output": ""}
            return result
        finally:
            self._judges.put(judge)

    def _judged(self, line: dict) -> dict:
        result = self._submit(line)
        if "unavailable" in result:
            raise SandboxUnavailable(
                f"the code sandbox cannot isolate programs as reward.sandbox_isolation="
                f"{self.isolation!r} asks ({result['unavailable']}); {_FIXES[self.isolation]}")
        return result

    def map(self, programs: list[tuple[str, Tests]]) -> list[RunResult]:
        """Each program judged against its tests, in order."""
        lines = [job(_kind(tests), code, self.limits, tests=tests, compare=self.io_compare,
                     tol=self.float_tol) for code, tests in programs]
        results = self._executor.map(self._judged, lines)
        return [RunResult(r["passed"], r["total"], r["reason"], r.get("output", ""))
                for r in results]

    def run_script(self, code: str, stdin: str = "") -> ScriptResult:
        """``code`` run once as __main__ with ``stdin``: what it wrote and how it ended."""
        r = self._judged(job("script", code, self.limits, stdin=stdin))
        return ScriptResult(r["stdout"], r["stderr"], r["exit"], r["reason"])

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for _ in range(self._workers):
            judge = self._judges.get()
            if judge is not None:
                judge.kill(wait_s=_JUDGE_SLACK_S)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def run_program(code: str, tests: Tests, limits: SandboxLimits = SandboxLimits(),
                isolation: str = "strict") -> RunResult:
    """Judges one program (a pool of one judge, started and closed here)."""
    with SandboxPool(1, limits, isolation) as pool:
        return pool.map([(code, tests)])[0]
