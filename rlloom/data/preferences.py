"""Preference pairs for offline training (DPO): rows of prompt, chosen, rejected, in TRL's
plain or conversational form, from jsonl, parquet or a `save_to_disk` directory."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlloom.data.chat import Prompt, read_prompt, read_response, with_system
from rlloom.data.row_files import DataError, read_rows


@dataclass(frozen=True)
class PreferencePair:
    prompt: Prompt  # text, or chat turns
    chosen: str     # the preferred response
    rejected: str


def read_preference_file(path: str | Path, transform: str | None = None,
                         system: str | None = None) -> list[PreferencePair]:
    """Every row of a preference file, validated; errors name the file and row.

    A row holds `prompt` (text or chat turns) and `chosen` and `rejected` (text, or one
    assistant turn each); `transform` and `system` work as in `read_prompt_file`."""
    pairs = []
    for where, row in read_rows(path, "preference file", transform):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise DataError(f"{where}: missing fields {missing}; a preference row has an "
                            f"explicit prompt, chosen and rejected (it has {list(row)})")
        pairs.append(PreferencePair(with_system(read_prompt(row["prompt"], where), system),
                                    read_response(row["chosen"], where, "chosen"),
                                    read_response(row["rejected"], where, "rejected")))
    return pairs
