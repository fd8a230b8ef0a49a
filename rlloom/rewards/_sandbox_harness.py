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


def _run_candidate(code: str, tests: list[str]) -> tuple[int, str]:
    ns: dict = {"__name__": "solution"}
    try:
        compiled = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError):
        return 0, "syntax error"
    try:
        exec(compiled, ns)
    except MemoryError:
        return 0, "memory limit"
    except SystemExit:
        return 0, "exit"
    except BaseException as e:  # noqa: BLE001 - any crash of the candidate scores 0
        # the message goes with the output (a tool call reads it back; rewards ignore it)
        os.write(2, f"{type(e).__name__}: {e}\n".encode("utf-8", "replace"))
        return 0, f"error: {type(e).__name__}"
    passed, reason = 0, "-"
    for test in tests:
        try:
            exec(compile(test, "<test>", "exec"), ns)
            passed += 1
        except MemoryError:
            reason = "memory limit"
        except BaseException:  # noqa: BLE001 - a failing test just doesn't count
            pass
    return passed, reason


def _child(token: str, workdir: str, code: str, tests: list[str], args: list[int]) -> None:
    cpu_s, memory_mb, file_size_mb, max_processes, uid = args
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _limit(cpu_s, memory_mb, file_size_mb, max_processes)
    if uid >= 0:
        _drop(uid)
    _guard(workdir)
    passed, reason = _run_candidate(code, tests)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the candidate may have broken its streams
            pass
    # os.write and os._exit: the candidate may have replaced sys.stdout or registered atexit.
    os.write(1, f"\n{token} result {passed} {len(tests)} {reason}\n".encode())
    os._exit(0)


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
    token = sys.stdin.readline().strip()
    with open(os.path.join(workdir, "solution.py"), encoding="utf-8") as f:
        code = f.read()
    with open(os.path.join(workdir, "tests.json"), encoding="utf-8") as f:
        tests = json.load(f)
    _isolate(as_root=os.geteuid() == 0)
    child = 0
    # The host asks us to stop with SIGTERM; killing pid 1 takes the whole namespace down.
    signal.signal(signal.SIGTERM, lambda *_: child and os.kill(child, signal.SIGKILL))
    child = os.fork()
    if child == 0:
        try:
            _child(token, workdir, code, tests, args)
        finally:
            os._exit(1)  # never fall back into the parent's code
    _, status, usage = os.wait4(child, 0)
    reason = _describe(status, usage.ru_utime + usage.ru_stime, args[0])
    os.write(1, f"\n{token} status {reason}\n".encode())


if __name__ == "__main__":
    main()
