"""Console progress with the latest metrics: a live bar in a terminal; plain lines when stdout
is a file or a pipe (Slurm logs, CI), where a live bar collapses into one squashed line."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Bar(Protocol):
    def advance(self, **metrics: float | None) -> None: ...

    def stage(self, name: str) -> None:
        """Show the stage now running (a live bar only: a plain line per step says enough)."""


def _text(metrics: dict[str, float | None]) -> str:
    return "  ".join(f"{k}={v:.3g}" for k, v in metrics.items() if v is not None)


class _LiveBar:
    def __init__(self, progress: Progress, task: int) -> None:
        self._progress, self._task = progress, task

    def advance(self, **metrics: float | None) -> None:
        self._progress.update(self._task, advance=1, metrics=_text(metrics))

    def stage(self, name: str) -> None:
        self._progress.update(self._task, stage=name)


class _Lines:
    """One line every `every` steps (and at the last): label, step of total, elapsed time and
    the metrics."""

    def __init__(self, label: str, total: int, done: int, every: int) -> None:
        self.label, self.total, self.done, self.every = label, total, done, every
        self.start = time.perf_counter()

    def advance(self, **metrics: float | None) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            elapsed = time.perf_counter() - self.start
            print(f"{self.label} {self.done}/{self.total} {elapsed:.0f}s  {_text(metrics)}",
                  flush=True)

    def stage(self, name: str) -> None:
        pass


@contextmanager
def progress_bar(label: str, total: int, done: int = 0, show: bool = True,
                 every: int = 0) -> Iterator[Bar]:
    """`show=False` for all but one process of a distributed run. Without a terminal, a line
    every `every` steps (0: about 20 lines over the whole bar)."""
    if show and not Console(file=sys.stdout).is_terminal:
        yield _Lines(label, total, done, every or max(1, total // 20))
        return
    progress = Progress(TextColumn(f"[bold]{label}"), TextColumn("{task.fields[stage]:<10}"),
                        BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(),
                        TextColumn("{task.fields[metrics]}"), transient=False, disable=not show)
    with progress:
        yield _LiveBar(progress, progress.add_task(label, total=total, completed=done,
                                                   metrics="", stage=""))
