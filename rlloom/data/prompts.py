"""Prompt sets: the built-in generated tasks or a prompt file, split into train and eval, and
a resumable stream over the training prompts."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlloom.data.chat import read_prompt, with_system
from rlloom.data.row_files import DataError, read_rows
from rlloom.data.synthetic import Problem, generate

if TYPE_CHECKING:
    from rlloom.config_sections import DataSection

# Fields each task's reward needs in a prompt-file row, beyond "prompt".
REQUIRED_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "arith": {"answer": (str, int)},
    # Python assert statements, or stdin/stdout cases {"input": str, "output": str}; a
    # response scores the fraction it passes (rewards/sandbox.py)
    "code": {"tests": list},
    "countdown": {"numbers": list, "target": int},
    "math": {"answer": (str, int, float)},
    "multiply": {"answer": (str, int)},
    "none": {},  # no verifier: the user's reward functions read the row's columns
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
    io = isinstance(tests[0], dict)
    for i, test in enumerate(tests):
        if io:
            if not (isinstance(test, dict) and set(test) == {"input", "output"}
                    and all(isinstance(v, str) for v in test.values())):
                raise DataError(f"{where}: field 'tests' item {i} is {test!r:.80}; stdin/stdout "
                                'tests are {"input": str, "output": str}, every one of them')
        elif not isinstance(test, str):
            raise DataError(f"{where}: field 'tests' item {i} has type {type(test).__name__}; "
                            "each test must be a string of Python assert statements (or every "
                            'test a stdin/stdout case {"input": str, "output": str})')
        elif not test.strip():
            raise DataError(f"{where}: field 'tests' item {i} is blank")


def _row_to_problem(row: Any, task: str, where: str, columns: dict[str, str] | None = None,
                    system: str | None = None) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if columns:
        row = _rename_columns(row, columns, where)
    if "prompt" not in row and "messages" in row:  # TRL's and verl's name for chat turns
        turns = row["messages"]
        rest = {k: v for k, v in row.items() if k != "messages"}
        last = turns[-1] if isinstance(turns, list) and len(turns) > 1 else None
        if isinstance(last, dict) and last.get("role") == "assistant" and \
                isinstance(last.get("content"), str) and "solution" not in row:
            # TRL's conversational SFT rows end with the answer: it is the worked solution
            rest["solution"] = turns[-1].get("content")
            turns = turns[:-1]
        row = {"prompt": turns, **rest}
    if "prompt" not in row:
        raise DataError(f"{where}: missing field 'prompt' (or 'messages'); the row has columns "
                        f"{list(row)}")
    prompt = with_system(read_prompt(row["prompt"], where), system)
    for name, kind in REQUIRED_FIELDS[task].items():
        if name not in row:
            raise DataError(f"{where}: missing field {name!r} required by task {task!r} (its "
                            f"verifier); the row has columns {list(row)}; map a column with "
                            "data.columns, or set data.task=none to score only with "
                            "reward.functions")
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            raise DataError(f"{where}: field {name!r} has type {type(row[name]).__name__}, "
                            f"task {task!r} needs {getattr(kind, '__name__', kind)}")
    if task == "countdown" and not all(isinstance(n, int) for n in row["numbers"]):
        raise DataError(f"{where}: field 'numbers' must be a list of integers")
    if task == "code":
        _check_tests(row["tests"], where)
        answer = ""  # the tests, kept in meta, are what a response is checked against
    else:
        answer = str(row["target"] if task == "countdown" else row.get("answer", ""))
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "solution")}
    return Problem(prompt=prompt, answer=answer, solution=str(row.get("solution", "")),
                   meta=meta, source=where)


def read_prompt_file(path: str | Path, task: str, columns: dict[str, str] | None = None,
                     transform: str | None = None, system: str | None = None) -> list[Problem]:
    """Every row of a prompt file, validated.

    The file is jsonl, parquet, or a directory written by `datasets` `save_to_disk` (see
    `read_rows`). Each row first goes through the user's `transform` (a resolved
    `module:function` spec). `columns` maps an rlloom field name to the file's column for it,
    e.g. {"prompt": "question", "answer": "gt"}; unmapped fields keep their own names. A prompt
    is text or chat turns (`prompt` or `messages`); `system` opens every prompt that has no
    system turn. Errors name the row: "file:line" for jsonl, "path row i" with i counted from
    0 for the others.
    """
    return [_row_to_problem(row, task, where, columns, system)
            for where, row in read_rows(path, "prompt file", transform)]


def load_prompt_sets(d: DataSection, seed: int) -> PromptSets:
    """The train and eval problems of `d`: the built-in task's (eval disjoint from train), or
    a prompt file's, split by `seed` unless `d.eval_file` holds the eval problems."""

    def read(path: str) -> list[Problem]:
        return read_prompt_file(path, d.task, d.columns, d.transform, d.system_prompt)

    if d.prompt_file and d.eval_file:
        return PromptSets(train=read(d.prompt_file), eval=read(d.eval_file))
    if d.prompt_file:
        return _split(read(d.prompt_file), d.eval_fraction, seed, d.prompt_file)
    if d.task == "none":  # no built-in problems: only held-out ones, for `rlloom eval`
        return PromptSets(train=[], eval=read(d.eval_file) if d.eval_file else [])
    raw = generate(d.task, d.train_size, seed=seed, difficulty=d.difficulty)
    train = [_with_system(p, d.system_prompt) for p in raw]
    if d.eval_file:
        return PromptSets(train=train, eval=read(d.eval_file))
    seen = {p.prompt for p in raw}
    # Draw held-out problems from another seed and drop any prompt the policy trains on.
    candidates = generate(d.task, d.eval_size * 3, seed=seed + 10_000_019,
                          difficulty=d.difficulty)
    held_out = [_with_system(p, d.system_prompt)
                for p in candidates if p.prompt not in seen][:d.eval_size]
    if len(held_out) < d.eval_size:
        raise DataError(f"task {d.task} at difficulty {d.difficulty} has too few distinct "
                        f"problems for {d.eval_size} held-out prompts; lower data.eval_size")
    return PromptSets(train=train, eval=held_out)


def _split(rows: list[Problem], fraction: float, seed: int, path: str) -> PromptSets:
    """A `fraction` of the distinct prompts held out, by `seed`: rows that repeat a prompt go
    to the same side (a held-out prompt also trained on would score what was learned by
    heart)."""
    groups: dict[str, list[Problem]] = {}
    for row in rows:
        key = row.prompt if isinstance(row.prompt, str) else json.dumps(row.prompt,
                                                                          sort_keys=True)
        groups.setdefault(key, []).append(row)
    if len(groups) < len(rows):
        print(f"{path}: {len(rows) - len(groups)} of {len(rows)} rows repeat another row's "
              f"prompt; each of the {len(groups)} distinct prompts is held out or trained on "
              "with all its rows")
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(order) * fraction)) if len(order) > 1 else 0
    return PromptSets(train=[r for g in order[n_eval:] for r in g],
                      eval=[r for g in order[:n_eval] for r in g])


def _with_system(problem: Problem, system: str | None) -> Problem:
    return replace(problem, prompt=with_system(problem.prompt, system)) if system else problem


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
