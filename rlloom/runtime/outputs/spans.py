"""Trace spans of the stages a worker runs, in Chrome's trace-event format (trace.json)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class SpanLog:
    """Chrome-trace events of one worker: pid is its group, tid the role's lane. Timestamps are
    wall-clock (time.time()), comparable across processes of one machine."""

    def __init__(self, group: str, keep: bool = True) -> None:
        self.group, self.keep = group, keep  # keep: false on ranks that repeat rank 0's spans
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self.on_start: Callable[[str], None] | None = None  # told each span's name as it opens

    @contextmanager
    def span(self, name: str, step: int, lane: str, **args: Any) -> Iterator[dict]:
        if self.on_start is not None:
            self.on_start(name)
        start, t0 = time.time(), time.perf_counter()
        info: dict[str, Any] = {}
        try:
            yield info
        finally:
            info["seconds"] = time.perf_counter() - t0
            event = {"name": name, "ph": "X", "pid": self.group, "tid": lane,
                     "ts": start * 1e6, "dur": info["seconds"] * 1e6,
                     "args": {"step": step, **args}}
            with self._lock:
                if self.keep:
                    self._events.append(event)

    def drain(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events
