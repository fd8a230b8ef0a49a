"""Prompt sets: the built-in generated tasks or a prompt file, split into train and eval, and
a resumable stream over the training prompts."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlloom.data.row_files import DataError, read_rows
from rlloom.data.synthetic import Difficulty, Problem, generate

# Fields each task's reward needs in a prompt-file row, beyond "prompt".
REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "arith": {"answer": (str, int)},
    "code": {"tests": list},  # Python assert statements; a response passes if all of them do
    "countdown": {"numbers": list, "target": int},
    "math": {"answer": (str, int, float)},
}


@dataclass
class PromptSets:
    train: list[Problem]
    eval: list[Problem]


def _rename_columns(row: dict[str, Any], columns: dict[str, str], where: str) -> dict[str, Any]:
    """`row` with each mapped file column under its rlloom field name."""
    for field, column in columns.items():
        if column not in row:
            raise DataError(f"{where}: missing column {column!r} (mapped to field {field!r}); "
                            f"the row has columns {list(row)}")
    # A mapped field's own column, if the file has one too, is dropped so the mapping wins.
    mapped = set(columns) | set(columns.values())
    renamed = {k: v for k, v in row.items() if k not in mapped}
    renamed.update({field: row[column] for field, column in columns.items()})
    return renamed


def _check_tests(tests: list, where: str) -> None:
    if not tests:
        # A problem with no tests has nothing to check a response against.
        raise DataError(f"{where}: field 'tests' is empty; the code task needs at least one")
    for i, test in enumerate(tests):
        if not isinstance(test, str):
            raise DataError(f"{where}: field 'tests' item {i} has type {type(test).__name__}; "
                            "each test must be a string of Python assert statements")
        if not test.strip():
            raise DataError(f"{where}: field 'tests' item {i} is blank")


def _row_to_problem(row: Any, task: str, where: str,
                    columns: dict[str, str] | None = None) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if columns:
        row = _rename_columns(row, columns, where)
    if "prompt" not in row:
        raise DataError(f"{where}: missing field 'prompt'; the row has columns {list(row)}")
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: field 'prompt' has type {type(prompt).__name__}, needs str")
    if not prompt.strip():
        raise DataError(f"{where}: empty prompt")
    for name, kind in REQUIRED_FIELDS[task].items():
        if name not in row:
            raise DataError(f"{where}: missing field {name!r} required by task {task!r}; "
                            f"the row has columns {list(row)}")
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise DataError(f"{where}: field {name!r} has type {type(row[name]).__name__}, "
                            f"task {task!r} needs {getattr(kind, '__name__', kind)}")
    if task == "countdown" and not all(isinstance(n, int) for n in row["numbers"]):
        raise DataError(f"{where}: field 'numbers' must be a list of integers")
    if task == "code":
        _check_tests(row["tests"], where)
        answer = ""  # the tests, kept in meta, are what a response is checked against
    else:
        answer = str(row["target"] if task == "countdown" else row["answer"])
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "solution")}
    return Problem(prompt=prompt, answer=answer, solution=str(row.get("solution", "")),
                   meta=meta, source=where)


def read_prompt_file(path: str | Path, task: str,
                     columns: dict[str, str] | None = None) -> list[Problem]:
    """Every row of a prompt file, validated.

    The file is jsonl, parquet, or a directory written by `datasets` `save_to_disk` (see
    `read_rows`). `columns` maps an rlloom field name to the file's column for it, e.g.
    {"prompt": "question", "answer": "gt"}; unmapped fields keep their own names. Errors name
    the row: "file:line" for jsonl, "path row i" with i counted from 0 for the others.
    """
    return [_row_to_problem(row, task, where, columns)
            for where, row in read_rows(path, "prompt file")]


def load_prompt_sets(task: str, difficulty: Difficulty, seed: int, train_size: int, eval_size: int,
                     prompt_file: str | None, eval_fraction: float,
                     columns: dict[str, str] | None = None) -> PromptSets:
    """Built-in task problems (eval disjoint from train) or a prompt file split by `seed`;
    `columns` is `read_prompt_file`'s column mapping."""
    if prompt_file:
        rows = read_prompt_file(prompt_file, task, columns)
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, round(len(rows) * eval_fraction)) if len(rows) > 1 else 0
        return PromptSets(train=[rows[i] for i in order[n_eval:]],
                          eval=[rows[i] for i in order[:n_eval]])
    train = generate(task, train_size, seed=seed, difficulty=difficulty)
    seen = {p.prompt for p in train}
    # Draw held-out problems from another seed and drop any prompt the policy trains on.
    candidates = generate(task, eval_size * 3, seed=seed + 10_000_019, difficulty=difficulty)
    held_out = [p for p in candidates if p.prompt not in seen][:eval_size]
    if len(held_out) < eval_size:
        raise DataError(f"task {task} at difficulty {difficulty} has too few distinct problems "
                        f"for {eval_size} held-out prompts; lower data.eval_size")
    return PromptSets(train=train, eval=held_out)


class PromptStream:
    """Endless walk over the training prompts, reshuffled each pass by (seed, pass).

    The position is one integer, saved in checkpoints so a resumed run neither repeats nor
    skips prompts.
    """

    def __init__(self, problems: list[Problem], seed: int) -> None:
        self.problems, self.seed, self.position = problems, seed, 0
        self._order: list[int] = []
        self._pass = -1

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._pass:
            self._order = list(range(len(self.problems)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._pass = epoch
        return self._order

    def next(self, n: int) -> list[Problem]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, len(self.problems))
            out.append(self.problems[self._order_for(epoch)[offset]])
            self.position += 1
        return out
