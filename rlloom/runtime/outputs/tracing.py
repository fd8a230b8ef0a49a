"""Stage spans of a run, written as a Chrome trace (opens in Perfetto / chrome://tracing)."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rlloom.runtime.outputs.files import write_atomic


class Span:
    seconds: float = 0.0


class Tracer:
    """Collects complete ("X") events; `tid` is the role or stage lane of the timeline."""

    def __init__(self, path: Path, process_name: str = "local") -> None:
        self.path = path
        self.process_name = process_name
        self.events: list[dict] = []
        if path.is_file():
            self.events = json.loads(path.read_text())["traceEvents"]

    @contextmanager
    def span(self, name: str, step: int, lane: str) -> Iterator[Span]:
        span = Span()
        start = time.time()
        t0 = time.perf_counter()
        try:
            yield span
        finally:
            span.seconds = time.perf_counter() - t0
            self.events.append({"name": name, "ph": "X", "pid": self.process_name, "tid": lane,
                                "ts": start * 1e6, "dur": span.seconds * 1e6,
                                "args": {"step": step}})

    def drop_after(self, step: int) -> None:
        """Forget spans of steps after `step` (a resumed run redoes them)."""
        self.events = [e for e in self.events if e.get("args", {}).get("step", 0) <= step]

    def save(self) -> None:
        write_atomic(self.path, json.dumps({"traceEvents": self.events,
                                            "displayTimeUnit": "ms"}))
