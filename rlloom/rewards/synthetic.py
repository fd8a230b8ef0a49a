"""Rewards for the built-in tasks of ``rlloom.data.synthetic``.

The final answer is whatever follows the last ``A:`` in the response; scoring
never raises on model output, however malformed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from rlloom.data.synthetic import Problem
from rlloom.rewards.expr import ExprError, evaluate, numbers_used

_MARK = "A:"
_FORMATTED_INT = re.compile(r"-?[0-9]+")
# Explicit ASCII digits: int() alone would also accept "1_0" and non-ASCII digits.
_ANY_INT = re.compile(r"[+-]?[0-9]+")
# int() refuses strings over ~4300 digits; no target is anywhere near this long.
_MAX_INT_CHARS = 64


@dataclass(frozen=True)
class Score:
    reward: float  # 1.0 * correct + format_weight * formatted
    correct: bool
    formatted: bool  # the response ends with a well-formed "A:<...>" line


def _arith(problem: Problem, answer: str) -> tuple[bool, bool]:
    formatted = _FORMATTED_INT.fullmatch(answer) is not None
    correct = (
        len(answer) <= _MAX_INT_CHARS
        and _ANY_INT.fullmatch(answer) is not None
        and int(answer) == int(problem.answer)
    )
    return correct, formatted


def _countdown(problem: Problem, answer: str) -> tuple[bool, bool]:
    try:
        value = evaluate(answer)
    except ExprError:
        return False, False
    correct = value == problem.meta["target"] and numbers_used(answer) == sorted(
        problem.meta["numbers"]
    )
    return correct, True


_CHECKS: dict[str, Callable[[Problem, str], tuple[bool, bool]]] = {
    "arith": _arith,
    "multiply": _arith,  # an integer answer line, like arith's
    "countdown": _countdown,
}


def score(problem: Problem, response: str, task: str, format_weight: float = 0.0) -> Score:
    """Correctness (1.0) plus ``format_weight`` for a well-formed answer line."""
    if task not in _CHECKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {sorted(_CHECKS)}")
    mark = response.rfind(_MARK)
    if mark < 0:
        return Score(reward=0.0, correct=False, formatted=False)
    correct, formatted = _CHECKS[task](problem, response[mark + len(_MARK) :].strip())
    reward = float(correct) + format_weight * formatted
    return Score(reward=reward, correct=correct, formatted=formatted)
