"""Preference pairs for offline training (DPO): jsonl rows of prompt, chosen, rejected."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlloom.data.prompts import DataError


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str     # the preferred response
    rejected: str


def read_preference_file(path: str | Path) -> list[PreferencePair]:
    """Every row of a jsonl preference file, validated; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"preference file {str(path)!r} does not exist")
    pairs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataError(f"{where}: field {key!r} must be a non-empty string")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"]))
    if not pairs:
        raise DataError(f"preference file {path} has no rows")
    return pairs
