"""Reward terms of each task, computed for a whole batch of responses.

Every task but `none` yields the terms "correct" (1/0; for code 1 when every unit test passes,
or with `reward.code_score=fraction` the fraction passed) and "format" (1 when the final answer is well-formed); `none` has no verifier and yields
no term (the user's reward functions score alone); the run's `reward.weights` combine terms
into the reward, and each term is logged on its own.
"""
from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Callable

from rlloom.data.synthetic import Problem
from rlloom.rewards import math, synthetic
from rlloom.rewards.sandbox import SandboxPool

if TYPE_CHECKING:
    from rlloom.config import RewardSection

Terms = dict[str, list[float]]


def _synthetic(task: str) -> Callable[[list[Problem], list[str], SandboxPool | None], Terms]:
    def terms(problems: list[Problem], responses: list[str], _: SandboxPool | None) -> Terms:
        scores = [synthetic.score(p, r, task) for p, r in zip(problems, responses)]
        return {"correct": [float(s.correct) for s in scores],
                "format": [float(s.formatted) for s in scores]}
    return terms


def _math(problems: list[Problem], responses: list[str], _: SandboxPool | None) -> Terms:
    scores = [math.score_math(r, p.answer) for p, r in zip(problems, responses)]
    return {"correct": [float(s.correct) for s in scores],
            "format": [float(s.formatted) for s in scores]}


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


CODE_SCORES = ("all", "fraction")


def _code(problems: list[Problem], responses: list[str], pool: SandboxPool | None,
          code_score: str) -> Terms:
    if pool is None:
        raise ValueError("the code task needs a SandboxPool to run the programs")
    results = pool.map([(r, p.meta["tests"]) for p, r in zip(problems, responses)])
    correct = [res.fraction if code_score == "fraction" else
               float(res.total > 0 and res.passed == res.total) for res in results]
    return {"correct": correct, "format": [float(_parses(r)) for r in responses]}


TASK_TERMS: dict[str, Callable[[list[Problem], list[str], SandboxPool | None], Terms]] = {
    "arith": _synthetic("arith"), "countdown": _synthetic("countdown"), "math": _math,
    "multiply": _synthetic("multiply"),
    "none": lambda problems, responses, pool: {}}


def task_terms(problems: list[Problem], responses: list[str], task: str,
               pool: SandboxPool | None = None, code_score: str = "all") -> Terms:
    """Reward terms of `responses[i]` to `problems[i]` under the task's verifier; the code
    task scores a program 1 when it passes every test (``code_score="all"``, as DeepCoder
    and most code-RL recipes do) or the fraction it passes (``"fraction"``: partial
    solutions, and programs that hard-code the cases they can guess, earn reward)."""
    if code_score not in CODE_SCORES:
        raise ValueError(f"code_score must be one of {CODE_SCORES}, not {code_score!r}")
    if task == "code":
        return _code(problems, responses, pool, code_score)
    return TASK_TERMS[task](problems, responses, pool)


def sandbox_pool(reward: RewardSection) -> SandboxPool:
    """The code task's pool as a run's `reward` section asks for it."""
    return SandboxPool(reward.sandbox_workers, isolation=reward.sandbox_isolation,
                       io_compare=reward.code_compare, float_tol=reward.code_float_tol)
