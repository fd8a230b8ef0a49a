"""Run a function under a hard deadline in a killable worker process.

Threads cannot bound CPU-heavy Python work: a long C-level operation (a huge integer power in
sympy, say) holds the GIL, so even the thread waiting on the deadline cannot wake up. A worker
process can always be killed, which is the only reliable bound off the main thread.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_READY = "ready"
# Starting a worker imports its function's module afresh; that must not count against a call.
_STARTUP_TIMEOUT_S = 120.0


def _serve(conn: Connection) -> None:
    conn.send(_READY)
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, fn(*args)))
        except Exception as exc:  # the caller decides what a failure means
            conn.send((False, repr(exc)))


class _Worker:
    # A fresh interpreter via ``-m`` rather than multiprocessing: fork is unsafe once threads
    # run, and spawn re-runs the caller's ``__main__``, which breaks scripts without a guard.
    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        if not self.conn.poll(_STARTUP_TIMEOUT_S) or self.conn.recv() != _READY:
            self.kill()
            raise RuntimeError("bounded worker process did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class WorkerPool:
    """Reusable worker processes, one per concurrent caller; a worker that overruns is killed."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)`` in a worker; ``fn`` must be a module-level (picklable) function.

        Raises TimeoutError past ``timeout_s`` and RuntimeError if ``fn`` raised or the worker
        died.
        """
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker()
        try:
            worker.conn.send((fn, args))
            if not worker.conn.poll(timeout_s):
                raise TimeoutError(f"call exceeded {timeout_s} s")
            ok, value = worker.conn.recv()
        except (EOFError, OSError) as exc:
            worker.kill()
            raise RuntimeError("bounded worker process died") from exc
        except BaseException:
            worker.kill()
            raise
        with self._lock:
            self._idle.append(worker)
        if not ok:
            raise RuntimeError(value)
        return value


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
