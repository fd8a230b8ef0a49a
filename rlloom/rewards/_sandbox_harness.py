"""Harness run by ``rlloom.rewards.sandbox`` as ``python -I -S -B _sandbox_harness.py ARGS``.

Stdlib only: it runs under a bare interpreter without site-packages. The process starts with the
host's privileges, isolates itself (namespaces), then forks; the child limits itself, drops to
the sandbox uid and only then runs the candidate. The parent stays behind to reap the child and
report how it ended, so it never runs untrusted code.

argv: workdir cpu_s memory_mb file_size_mb max_processes uid (uid -1: keep the current uid)
stdin: the per-run token, one line.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _isolate(as_root: bool) -> None:
    # The forked child becomes pid 1 of a new pid namespace: when it dies the kernel kills and
    # reaps everything it started, even processes that left our session (this machine's init
    # does not reap orphans). The new network namespace has only a down loopback device.
    libc = ctypes.CDLL(None, use_errno=True)
    flags = _CLONE_NEWNET | _CLONE_NEWPID
    if libc.unshare(flags if as_root else flags | _CLONE_NEWUSER) != 0:
        if as_root:
            raise OSError(ctypes.get_errno(), "unshare failed")
        # Unprivileged and no user namespaces: run without network/pid isolation.


def _limit(cpu_s: int, memory_mb: int, file_size_mb: int, max_processes: int) -> None:
    mb = 1024 * 1024
    # soft == hard: pid 1 ignores SIGXCPU, so only the hard limit's SIGKILL would stop it.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * mb, memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_mb * mb, file_size_mb * mb))
    resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _drop(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _guard(workdir: str) -> None:
    # Defence in depth only: ctypes can bypass audit hooks. The real barriers are the uid and
    # the network namespace.
    root = os.path.realpath(workdir) + os.sep

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writes and isinstance(path, (str, bytes)):
                full = os.path.realpath(os.path.join(workdir, os.fsdecode(path)))
                if not full.startswith(root):
                    raise PermissionError(f"sandbox: writing outside the workdir: {full}")
        elif event in ("socket.connect", "socket.sendto", "socket.sendmsg"):
            raise PermissionError("sandbox: network access is disabled")

    sys.addaudithook(hook)


_REPORT, _STRICT_EQ = "__rlloom_report__", "__rlloom_eq__"
_MAX_ITEMS = 100_000  # elements of one reported value
_MAX_REPORT_BYTES = 4 << 20
_BUILTIN_TYPES = {bool: "b", int: "i", float: "f", str: "s", type(None): "n", list: "l",
                  tuple: "t", dict: "d", set: "S", frozenset: "S"}


def _plain(value: object, budget: list[int]) -> list:
    """`value` as tagged plain data, checked by exact builtin type (a subclass of int, str or
    list, or any object of the candidate's, is refused with TypeError): ["i", 3], ["l", [...]],
    ["d", [k, v, k, v, ...]], ..."""
    budget[0] -= 1
    if budget[0] < 0:
        raise TypeError("value too large")
    kind = _BUILTIN_TYPES.get(type(value))
    if kind is None:
        raise TypeError(f"not plain data: {type(value).__name__}")
    if kind == "n":
        return ["n"]
    if kind == "f":
        return ["f", float.__repr__(value)]
    if kind in "bis":
        return [kind, value]
    if kind == "d":
        return ["d", [item for k, v in dict.items(value)
                      for item in (_plain(k, budget), _plain(v, budget))]]
    return [kind, [_plain(v, budget) for v in value]]


def _strict_eq(a: object, b: object) -> bool:
    """`a == b` for plain data only: anything else (an always-equal object) is unequal."""
    try:
        _plain(a, [_MAX_ITEMS])
        _plain(b, [_MAX_ITEMS])
    except (TypeError, RecursionError):
        return False
    return a == b


def _run_candidate(code: str, tests: list[str]) -> dict:
    """Runs the candidate, then each test in a scope of its own (the candidate's names plus
    the report helpers, set last so a candidate cannot shadow them): which tests ran to their
    end, and the values their rewritten asserts reported (rlloom.rewards.test_rewrite)."""
    ns: dict = {"__name__": "solution"}
    out: dict = {"reason": "-", "completed": [], "reports": []}
    try:
        compiled = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError):
        return {**out, "reason": "syntax error"}
    try:
        exec(compiled, ns)
    except MemoryError:
        return {**out, "reason": "memory limit"}
    except SystemExit:
        return {**out, "reason": "exit"}
    except BaseException as e:  # noqa: BLE001 - any crash of the candidate scores 0
        # the message goes with the output (a tool call reads it back; rewards ignore it)
        os.write(2, f"{type(e).__name__}: {e}\n".encode("utf-8", "replace"))
        return {**out, "reason": f"error: {type(e).__name__}"}
    reports = out["reports"]

    def report(index: int, value: object) -> None:
        try:
            reports.append([index, _plain(value, [_MAX_ITEMS])])
        except (TypeError, RecursionError):
            reports.append([index, ["x"]])  # not plain data: the host counts it a failure

    for test in tests:
        scope = dict(ns)
        scope[_REPORT], scope[_STRICT_EQ] = report, _strict_eq
        try:
            exec(compile(test, "<test>", "exec"), scope)
            out["completed"].append(True)
        except MemoryError:
            out["reason"] = "memory limit"
            out["completed"].append(False)
        except BaseException:  # noqa: BLE001 - a failing test just doesn't count
            out["completed"].append(False)
    return out


def _child(wfd: int, workdir: str, code: str, tests: list[str], args: list[int]) -> None:
    cpu_s, memory_mb, file_size_mb, max_processes, uid = args
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _limit(cpu_s, memory_mb, file_size_mb, max_processes)
    if uid >= 0:
        _drop(uid)
    _guard(workdir)
    result = _run_candidate(code, tests)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the candidate may have broken its streams
            pass
    # os.write and os._exit: the candidate may have replaced sys.stdout or registered atexit.
    try:
        payload = json.dumps(result).encode()
    except BaseException:  # noqa: BLE001 - the candidate may have broken json
        payload = b""
    while payload:
        payload = payload[os.write(wfd, payload[:65536]):]
    os._exit(0)


def _read_report(rfd: int) -> bytes:
    """What the child wrote to its report pipe, up to a limit."""
    got = bytearray()
    while True:
        chunk = os.read(rfd, 65536)
        if not chunk:
            return bytes(got)
        if len(got) + len(chunk) > _MAX_REPORT_BYTES:
            return b""
        got += chunk


def _describe(status: int, cpu: float, cpu_s: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in (signal.SIGKILL, signal.SIGXCPU) and cpu >= cpu_s - 0.05:
            return "cpu limit"
        return f"killed by signal {sig}"
    code = os.WEXITSTATUS(status)
    return f"exit code {code}" if code else "-"


def main() -> None:
    workdir, *rest = sys.argv[1:]
    args = [int(a) for a in rest]
    with open(os.path.join(workdir, "solution.py"), encoding="utf-8") as f:
        code = f.read()
    with open(os.path.join(workdir, "tests.json"), encoding="utf-8") as f:
        tests = json.load(f)
    _isolate(as_root=os.geteuid() == 0)
    rfd, wfd = os.pipe()
    child = 0
    # The host asks us to stop with SIGTERM; killing pid 1 takes the whole namespace down.
    signal.signal(signal.SIGTERM, lambda *_: child and os.kill(child, signal.SIGKILL))
    child = os.fork()
    if child == 0:
        try:
            # the token is read after the fork, by the parent: it never exists in this process
            os.close(0)
            os.close(rfd)
            _child(wfd, workdir, code, tests, args)
        finally:
            os._exit(1)  # never fall back into the parent's code
    os.close(wfd)
    token = sys.stdin.readline().strip()
    report = _read_report(rfd)
    _, status, usage = os.wait4(child, 0)
    reason = _describe(status, usage.ru_utime + usage.ru_stime, args[0])
    if report:
        os.write(1, f"\n{token} report ".encode() + report + b"\n")
    os.write(1, f"\n{token} status {reason}\n".encode())


if __name__ == "__main__":
    main()
