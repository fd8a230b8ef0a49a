"""Live console progress with the latest metrics."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class Bar:
    def __init__(self, progress: Progress, task: int) -> None:
        self._progress, self._task = progress, task

    def advance(self, **metrics: float | None) -> None:
        text = "  ".join(f"{k}={v:.3g}" for k, v in metrics.items() if v is not None)
        self._progress.update(self._task, advance=1, metrics=text)


@contextmanager
def progress_bar(label: str, total: int, done: int = 0, show: bool = True) -> Iterator[Bar]:
    """`show=False` for all but one process of a distributed run."""
    progress = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                        TextColumn("{task.fields[metrics]}"), transient=False, disable=not show)
    with progress:
        yield Bar(progress, progress.add_task(label, total=total, completed=done, metrics=""))
