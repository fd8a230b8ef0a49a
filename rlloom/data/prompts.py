"""Prompt sets: the built-in generated tasks or a jsonl file, split into train and eval, and a
resumable stream over the training prompts."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlloom.data.synthetic import Problem, generate

# Fields each task's reward needs in a prompt-file row, beyond "prompt".
REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "arith": {"answer": (str, int)},
    "countdown": {"numbers": list, "target": int},
    "math": {"answer": (str, int, float)},
}


class DataError(ValueError):
    pass


@dataclass
class PromptSets:
    train: list[Problem]
    eval: list[Problem]


def _row_to_problem(row: Any, task: str, where: str) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise DataError(f"{where}: missing or non-string 'prompt' field")
    if not prompt.strip():
        raise DataError(f"{where}: empty prompt")
    for name, kind in REQUIRED_FIELDS[task].items():
        if name not in row:
            raise DataError(f"{where}: missing field {name!r} required by task {task!r}")
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise DataError(f"{where}: field {name!r} has type {type(row[name]).__name__}, "
                            f"task {task!r} needs {getattr(kind, '__name__', kind)}")
    if task == "countdown" and not all(isinstance(n, int) for n in row["numbers"]):
        raise DataError(f"{where}: field 'numbers' must be a list of integers")
    answer = str(row["target"] if task == "countdown" else row["answer"])
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "solution")}
    return Problem(prompt=prompt, answer=answer, solution=str(row.get("solution", "")),
                   meta=meta)


def read_jsonl(path: str | Path, what: str) -> list[tuple[str, Any]]:
    """(where, row) for every non-blank line of a jsonl file; `where` is "file:line"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {str(path)!r} does not exist")
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg})") from None
    if not rows:
        raise DataError(f"{what} {path} has no rows")
    return rows


def read_prompt_file(path: str | Path, task: str) -> list[Problem]:
    """Every row of a jsonl prompt file, validated; errors name the file and line."""
    return [_row_to_problem(row, task, where) for where, row in read_jsonl(path, "prompt file")]


def load_prompt_sets(task: str, difficulty: int, seed: int, train_size: int, eval_size: int,
                     prompt_file: str | None, eval_fraction: float) -> PromptSets:
    """Built-in task problems (eval disjoint from train) or a prompt file split by `seed`."""
    if prompt_file:
        rows = read_prompt_file(prompt_file, task)
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
