"""Per-step metrics as JSON lines, safe to resume: lines of steps after a checkpoint are cut.

Each row is appended with one write on an O_APPEND descriptor, then fsync'd, so a crash
leaves at most a cut last line; a line that does not parse (a cut one, or a damaged one) is
reported with its number and left out, and the rows after it are kept."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlloom.runtime.outputs.files import append_line, write_atomic


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        rows = []
        text = self.path.read_bytes().decode("utf-8", "replace")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
            elif line.strip():
                print(f"{self.path}:{number}: not a metrics row ({line[:60]!r}); left out")
        return rows

    def truncate_after(self, step: int) -> None:
        rows = [r for r in self.rows() if r["step"] <= step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def append(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}
        append_line(self.path, json.dumps(clean))
