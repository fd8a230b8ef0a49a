"""Rows of a local data file, each tagged with where it came from for error messages: jsonl,
parquet, or a directory written by Hugging Face `datasets` `save_to_disk`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import rlloom.user_code as user_code

# Files `save_to_disk` writes: one of the first two marks a Dataset, the last a DatasetDict.
_DATASET_MARKERS = ("dataset_info.json", "state.json")
_DATASET_DICT_MARKER = "dataset_dict.json"


class DataError(ValueError):
    """A data file, row or data transform that cannot be used."""


def read_rows(path: str | Path, what: str, transform: str | None = None
              ) -> list[tuple[str, Any]]:
    """(where, row) for every row of a jsonl file, a parquet file or a `save_to_disk` directory,
    each passed through the user's `transform` function (a resolved `module:function` spec)
    when one is given.

    The format follows the path: a directory is a saved dataset (a DatasetDict gives its "train"
    split), a `.parquet` suffix is parquet, anything else is jsonl. `where` is "file:line" for
    jsonl and "path row i", with i counted from 0, for the others.
    """
    path = Path(path)
    if path.is_dir():
        rows = read_saved_dataset(path, what)
    elif path.suffix == ".parquet":
        rows = read_parquet(path, what)
    else:
        rows = read_jsonl(path, what)
    return [(where, _transformed(transform, row, where)) for where, row in rows] if transform \
        else rows


def _transformed(spec: str, row: Any, where: str) -> dict[str, Any]:
    name, fn = user_code.load(spec, "data transform", DataError)
    try:
        out = fn(row)
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise DataError(f"{where}: data transform {name!r} raised {type(e).__name__}: {e}"
                        ) from e
    if not isinstance(out, dict):
        raise DataError(f"{where}: data transform {name!r} returned {type(out).__name__}; it "
                        "must return the row as a dict")
    return out


def _given_rows(path: Path) -> str | None:
    """"train_dataset" / "eval_dataset" for the file `rlloom.train` stored rows given in
    memory as (the cache's api/datasets/<name>-<hash>.jsonl, one row a line), so that an
    error names the row by its index in what the user passed, not a cache file."""
    name = path.name.split("-", 1)[0]
    if path.parent.name == "datasets" and path.parent.parent.name == "api" and \
            name in ("train", "eval"):
        return f"{name}_dataset"
    return None


def read_jsonl(path: str | Path, what: str) -> list[tuple[str, Any]]:
    """(where, row) for every non-blank line of a jsonl file; `where` is "file:line"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {str(path)!r} does not exist")
    rows = []
    given = _given_rows(path)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{given} row {lineno - 1}" if given else f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                f"{e.start + 1}); re-encode the file as UTF-8, e.g. iconv -f "
                                "latin1 -t utf-8") from None
            if not line.strip():
                continue
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not rows:
        raise DataError(f"{what} {path} has no rows")
    return rows


def read_parquet(path: str | Path, what: str) -> list[tuple[str, Any]]:
    """(where, row) for every row of a parquet file; `where` is "path row i", i from 0."""
    # pyarrow (which `datasets` depends on) reads the file in place; going through
    # `datasets.load_dataset` would copy it into the Hugging Face cache first.
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {str(path)!r} does not exist")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{what} {path} is not a readable parquet file ({e})") from None
    return _tag_rows(path, table.to_pylist(), what)


def read_saved_dataset(path: str | Path, what: str) -> list[tuple[str, Any]]:
    """(where, row) for every row of a `save_to_disk` directory, or of its "train" split if it
    holds a DatasetDict; `where` is "directory row i", i from 0."""
    path = Path(path)
    is_dict = (path / _DATASET_DICT_MARKER).is_file()
    if not is_dict and not any((path / name).is_file() for name in _DATASET_MARKERS):
        markers = [*_DATASET_MARKERS, _DATASET_DICT_MARKER]
        raise DataError(f"{what} {path} is a directory but not one written by datasets' "
                        f"save_to_disk (it has none of {markers})")
    import datasets  # imported here: it takes most of a second and only these files need it

    try:
        # load_from_disk memory-maps the arrow files where they are and writes no cache.
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"{what} {path} could not be loaded as a saved dataset ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{what} {path} is a DatasetDict without a 'train' split; its splits "
                            f"are {sorted(loaded)}")
        return _tag_rows(path / "train", loaded["train"].to_list(), what)
    return _tag_rows(path, loaded.to_list(), what)


def _tag_rows(path: Path, rows: list[dict[str, Any]], what: str) -> list[tuple[str, Any]]:
    if not rows:
        raise DataError(f"{what} {path} has no rows")
    # A table has every column in every row, so a row that lacks a field holds a null there.
    # Dropping nulls reads it the same as the jsonl row that leaves the key out.
    return [(f"{path} row {i}", {k: v for k, v in row.items() if v is not None})
            for i, row in enumerate(rows)]
