"""Deterministic generators for built-in tasks whose answers can be checked exactly.

Tasks:
- ``arith``: a left-to-right chain of ``difficulty`` (1..32) additions/subtractions of
  single-digit integers, e.g. prompt ``Q:7+5-8=``, solution ``7+5=12,12-8=4.A:4``.
  Single digits keep the per-step arithmetic learnable by a tiny model in a minute of
  SFT; the number of steps is what makes it hard.
- ``code``: write ``f`` from three input/output examples, checked by unit tests in the
  sandbox, e.g. prompt ``F:f(1)=5,f(2)=7,f(3)=9?``, solution ``def f(x): return 2*x+3``.
- ``multiply``: a ``difficulty``-digit (1..6) number times a two-digit one, e.g. prompt
  ``M:347*58=``; the solution calls the calculator tool,
  ``<call calculator>347*58</call><result>20126</result>A:20126``. Two layers cannot
  multiply such numbers; they can learn to copy them into a call and copy the result out.
- ``countdown``: reach a target in 1..200 using each of ``difficulty`` numbers
  exactly once with + - * /, e.g. prompt ``C:3,7,25=28?``, solution ``A:25+3``.
  Numbers are drawn from 1..20 for difficulty <= 3 and from 1..50 above, so
  bigger pools also reach less trivial targets.
"""

from __future__ import annotations

import functools
import operator
import random
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Problem:
    prompt: str | list[dict[str, str]]  # text, or chat turns; the response follows it
    answer: str  # canonical final answer string
    solution: str  # one correct response, ending with the answer line, no EOS
    meta: dict  # task-specific data used by the reward functions
    source: str = field(default="", compare=False)  # "file:line" of a prompt-file row


def row_columns(problems: list[Problem]) -> dict[str, list]:
    """The dataset columns of each problem but its prompt, one list per column (what a Python
    reward function gets as keyword arguments): answer, solution, and the columns every
    problem's `meta` has."""
    shared = set.intersection(*(set(p.meta) for p in problems)) if problems else set()
    columns = {"answer": [p.answer for p in problems],
               "solution": [p.solution for p in problems]}
    return {**columns, **{k: [p.meta[k] for p in problems] for k in sorted(shared)
                          if k not in columns}}


_DIFFICULTY = {"arith": (1, 32), "countdown": (2, 5), "code": (1, 3), "multiply": (1, 6)}
_TARGET_RANGE = (1, 200)
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
# Floor division is exact here because "/" is only chosen when it divides evenly.
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_ATOM = 3
_ARITH_MAX_OPERAND = 9


Difficulty = int | dict[int, float]  # one level, or a mixture: level -> weight


def check_difficulty(task: str, difficulty: Difficulty) -> None:
    lo, hi = _DIFFICULTY[task]
    levels = difficulty if isinstance(difficulty, dict) else {difficulty: 1.0}
    for level, weight in levels.items():
        if not lo <= level <= hi:
            raise ValueError(f"{task} difficulty must be in {lo}..{hi}, got {level}")
        if not weight > 0:
            raise ValueError(f"difficulty mixture weights must be > 0, got {level}: {weight}")
    if not levels:
        raise ValueError("a difficulty mixture needs at least one level, e.g. {1: 0.9, 16: 0.1}")


def _arith(rng: random.Random, difficulty: int) -> Problem:
    check_difficulty("arith", difficulty)
    value = rng.randint(0, _ARITH_MAX_OPERAND)
    expression = str(value)
    steps = []
    for _ in range(difficulty):
        op = rng.choice("+-")
        operand = rng.randint(0, _ARITH_MAX_OPERAND)
        result = value + operand if op == "+" else value - operand
        steps.append(f"{value}{op}{operand}={result}")
        expression += f"{op}{operand}"
        value = result
    return Problem(
        prompt=f"Q:{expression}=",
        answer=str(value),
        solution=",".join(steps) + f".A:{value}",
        meta={"expression": expression},
    )


def _multiply(rng: random.Random, difficulty: int) -> Problem:
    check_difficulty("multiply", difficulty)
    a, b = rng.randint(10 ** (difficulty - 1), 10 ** difficulty - 1), rng.randint(10, 99)
    return Problem(prompt=f"M:{a}*{b}=", answer=str(a * b),
                   solution=f"<call calculator>{a}*{b}</call><result>{a * b}</result>"
                            f"A:{a * b}",
                   meta={"expression": f"{a}*{b}"})


def _build(rng: random.Random, leaves: list[int]) -> tuple[int, str, int]:
    """Random expression tree over ``leaves`` in order: (value, text, precedence)."""
    if len(leaves) == 1:
        return leaves[0], str(leaves[0]), _ATOM
    split = rng.randint(1, len(leaves) - 1)
    left, left_text, left_prec = _build(rng, leaves[:split])
    right, right_text, right_prec = _build(rng, leaves[split:])
    # Only exact division keeps every intermediate value an integer.
    ops = "+-*/" if right != 0 and left % right == 0 else "+-*"
    op = rng.choice(ops)
    value = _APPLY[op](left, right)
    prec = _PRECEDENCE[op]
    if left_prec < prec:
        left_text = f"({left_text})"
    # a-(b+c) and a/(b*c) need parentheses; a+(b-c) and a*(b/c) do not.
    if right_prec < prec or (right_prec == prec and op in "-/"):
        right_text = f"({right_text})"
    return value, f"{left_text}{op}{right_text}", prec


def _countdown(rng: random.Random, difficulty: int) -> Problem:
    check_difficulty("countdown", difficulty)
    top = 20 if difficulty <= 3 else 50
    while True:  # most draws land in range, so this ends after a few tries
        numbers = [rng.randint(1, top) for _ in range(difficulty)]
        # Shuffled separately so the prompt order does not give away the solution.
        leaves = list(numbers)
        rng.shuffle(leaves)
        target, text, _ = _build(rng, leaves)
        if _TARGET_RANGE[0] <= target <= _TARGET_RANGE[1]:
            return Problem(
                prompt=f"C:{','.join(map(str, numbers))}={target}?",
                answer=str(target),
                solution=f"A:{text}",
                meta={"numbers": numbers, "target": target},
            )


def _code(rng: random.Random, difficulty: int) -> Problem:
    """Write `f` from examples: f(x) = x+b with b in 0..99 (1), a*x+b (2) or x*x+b*x+c (3)
    with a in 1..20 and b, c in 0..50: 100, 1020 and 2601 distinct functions.

    Three examples are shown; the tests check two other inputs only, so a lookup table of
    the examples passes none of them.
    """
    check_difficulty("code", difficulty)
    a, b, c = rng.randint(1, 20), rng.randint(0, 99 if difficulty == 1 else 50), rng.randint(0, 50)
    body = {1: f"x+{b}", 2: f"{a}*x+{b}", 3: f"x*x+{b}*x+{c}"}[difficulty]
    shown, hidden = [1, 2, 3], [rng.randint(5, 9), rng.randint(10, 20)]

    def f(x: int) -> int:
        return {1: x + b, 2: a * x + b, 3: x * x + b * x + c}[difficulty]

    tests = [f"assert f({x}) == {f(x)}" for x in hidden]
    return Problem(prompt="F:" + ",".join(f"f({x})={f(x)}" for x in shown) + "?",
                   answer="", solution=f"def f(x): return {body}",
                   meta={"tests": tests})


TASKS: dict[str, Callable[[random.Random, int], Problem]] = {
    "code": _code,
    "arith": _arith,
    "countdown": _countdown,
    "multiply": _multiply,
}


def generate(task: str, n: int, seed: int, difficulty: Difficulty) -> list[Problem]:
    """``n`` problems, fully determined by (task, n, seed, difficulty). A mixture
    ``{level: weight}`` draws each problem's level with those weights: a few long problems
    among many short ones give the long-tailed response lengths of reasoning RL."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {sorted(TASKS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # Checked up front too, so that n == 0 still rejects a bad difficulty.
    check_difficulty(task, difficulty)
    # the mixture's order is kept: it sets which level each draw picks
    key = difficulty if isinstance(difficulty, int) else tuple(difficulty.items())
    return list(_generated(task, n, seed, key))


@functools.lru_cache(maxsize=8)
def _generated(task: str, n: int, seed: int, difficulty: int | tuple[tuple[int, float], ...]
               ) -> tuple[Problem, ...]:
    """Cached: a run draws the same sets several times (its prompt check, its generation
    workers, its evaluation), 0.25 s each for the default 20,000 problems."""
    rng = random.Random(seed)
    if isinstance(difficulty, int):
        return tuple(TASKS[task](rng, difficulty) for _ in range(n))
    levels, weights = [level for level, _ in difficulty], [w for _, w in difficulty]
    return tuple(TASKS[task](rng, rng.choices(levels, weights)[0]) for _ in range(n))
