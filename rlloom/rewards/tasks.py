"""The verifier of each task name: the one place the runtime turns a response into a reward."""
from __future__ import annotations

from typing import Callable

from rlloom.data.synthetic import Problem
from rlloom.rewards import math, synthetic

# fn(problem, response, format_weight) -> (reward, correct)
Verifier = Callable[[Problem, str, float], tuple[float, bool]]


def _synthetic(task: str) -> Verifier:
    def verify(problem: Problem, response: str, format_weight: float) -> tuple[float, bool]:
        s = synthetic.score(problem, response, task, format_weight)
        return s.reward, s.correct
    return verify


def _math(problem: Problem, response: str, format_weight: float) -> tuple[float, bool]:
    s = math.score_math(response, problem.answer, format_weight)
    return s.reward, s.correct


VERIFIERS: dict[str, Verifier] = {"arith": _synthetic("arith"),
                                  "countdown": _synthetic("countdown"), "math": _math}


def verify(problem: Problem, response: str, task: str, format_weight: float = 0.0
           ) -> tuple[float, bool]:
    """(reward, correct) of `response` to `problem` under the task's verifier."""
    return VERIFIERS[task](problem, response, format_weight)
