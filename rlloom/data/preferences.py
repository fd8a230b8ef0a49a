"""Preference pairs for offline training (DPO): jsonl rows of prompt, chosen, rejected."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlloom.data.row_files import DataError, read_jsonl


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str     # the preferred response
    rejected: str


def read_preference_file(path: str | Path) -> list[PreferencePair]:
    """Every row of a jsonl preference file, validated; errors name the file and line."""
    pairs = []
    for where, row in read_jsonl(path, "preference file"):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in ("prompt", "chosen", "rejected"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataError(f"{where}: field {key!r} must be a non-empty string")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"]))
    return pairs
