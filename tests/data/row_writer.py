"""Rows written as each data format rlloom reads: jsonl, parquet, a `save_to_disk` directory."""
import json

import datasets

FORMATS = ["jsonl", "parquet", "saved"]


def write_rows(directory, fmt, rows, name="prompts"):
    """`rows` written in `fmt` under `directory`; the path to give a reader."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        path = directory / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = directory / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path
