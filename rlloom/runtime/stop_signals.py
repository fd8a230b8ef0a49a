"""SIGINT and SIGTERM (Ctrl-C, Slurm's and Kubernetes' preemption) end a run at a step
boundary: the step under way finishes, a checkpoint is written, the run says where it stopped
and how to continue, and exits with the conventional status (130, 143). A second signal
stops at once, as the default handlers would."""
from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped on a signal after checkpointing; `code` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class StopSignals:
    """While active, the first SIGINT or SIGTERM is remembered (``received``), not raised."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        for sig in SIGNALS:  # a second signal takes the default way out
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)

    def __enter__(self) -> StopSignals:
        # handlers can only be set from the main thread (a run started from another thread
        # keeps the default behaviour)
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""
