import random
import re

import pytest

from rlloom.data.synthetic import TASKS, Problem, generate
from rlloom.rewards.expr import evaluate, numbers_used

RANGES = {"arith": range(1, 7), "countdown": range(2, 6), "code": range(1, 4),
          "multiply": range(1, 7)}


class ScriptedRandom(random.Random):
    """Replays fixed draws so a generator's output can be checked by hand."""

    def __init__(self, ints: list[int], choices: list[str]) -> None:
        super().__init__(0)
        self.ints, self.choices = list(ints), list(choices)

    def randint(self, a: int, b: int) -> int:
        return self.ints.pop(0)

    def choice(self, seq: str) -> str:  # type: ignore[override]
        return self.choices.pop(0)


def test_registry_names() -> None:
    assert sorted(TASKS) == ["arith", "code", "countdown", "multiply"]


def test_code_hand_built() -> None:
    # draws: a=3, b=7, c=1, then the unseen inputs 6 and 12; f(x) = 3x + 7
    p = TASKS["code"](ScriptedRandom([3, 7, 1, 6, 12], []), 2)
    assert p.prompt == "F:f(1)=10,f(2)=13,f(3)=16?"
    assert p.solution == "def f(x): return 3*x+7"
    # the tests check only inputs the prompt does not show
    assert p.meta["tests"] == ["assert f(6) == 25", "assert f(12) == 43"]


def test_code_solutions_pass_their_tests_in_the_sandbox() -> None:
    from rlloom.rewards.sandbox import SandboxPool
    from rlloom.rewards.tasks import task_terms

    problems = [p for d in RANGES["code"] for p in generate("code", 10, seed=d, difficulty=d)]
    with SandboxPool(workers=2) as pool:
        terms = task_terms(problems, [p.solution for p in problems], "code", pool)
    assert terms == {"correct": [1.0] * 30, "format": [1.0] * 30}


def test_multiply_hand_built() -> None:
    # draws: the 3-digit factor 347, then the 2-digit 58
    p = TASKS["multiply"](ScriptedRandom([347, 58], []), 3)
    assert (p.prompt, p.answer) == ("M:347*58=", "20126")
    assert p.solution == "<call calculator>347*58</call><result>20126</result>A:20126"


def test_arith_hand_built() -> None:
    p = TASKS["arith"](ScriptedRandom([17, 25, 8], ["+", "-"]), 2)
    assert p == Problem("Q:17+25-8=", "34", "17+25=42,42-8=34.A:34", {"expression": "17+25-8"})


def test_arith_single_op_and_negatives() -> None:
    assert TASKS["arith"](ScriptedRandom([17, 25], ["+"]), 1).solution == "17+25=42.A:42"
    p = TASKS["arith"](ScriptedRandom([5, 9, 3], ["-", "+"]), 2)
    assert (p.prompt, p.answer, p.solution) == ("Q:5-9+3=", "-1", "5-9=-4,-4+3=-1.A:-1")


@pytest.mark.parametrize("difficulty", RANGES["arith"])
def test_arith_problems_consistent(difficulty: int) -> None:
    for p in generate("arith", 200, seed=difficulty, difficulty=difficulty):
        expression = p.meta["expression"]
        assert p.prompt == f"Q:{expression}="
        tokens = re.findall(r"[+-]|\d+", expression)
        assert len(tokens) == 2 * difficulty + 1
        assert all(0 <= int(t) <= 99 for t in tokens[::2])
        value = int(tokens[0])  # left-to-right, independent of the generator
        for op, operand in zip(tokens[1::2], tokens[2::2]):
            value += int(operand) if op == "+" else -int(operand)
        assert p.answer == str(value)
        assert p.solution.endswith(f".A:{value}")
        assert p.solution.count(",") == difficulty - 1
        assert (p.prompt + p.solution).isascii() and (p.prompt + p.solution).isprintable()


@pytest.mark.parametrize("difficulty", RANGES["countdown"])
def test_countdown_problems_consistent(difficulty: int) -> None:
    top = 20 if difficulty <= 3 else 50
    for p in generate("countdown", 200, seed=difficulty, difficulty=difficulty):
        numbers, target = p.meta["numbers"], p.meta["target"]
        assert len(numbers) == difficulty and all(1 <= n <= top for n in numbers)
        assert 1 <= target <= 200 and p.answer == str(target)
        assert p.prompt == "C:" + ",".join(map(str, numbers)) + f"={target}?"
        assert p.solution.startswith("A:")
        expression = p.solution[2:]
        assert evaluate(expression) == target
        assert numbers_used(expression) == sorted(numbers)
        assert (p.prompt + p.solution).isascii() and (p.prompt + p.solution).isprintable()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic(task: str) -> None:
    d = RANGES[task][0]
    assert generate(task, 50, seed=7, difficulty=d) == generate(task, 50, seed=7, difficulty=d)
    assert generate(task, 50, seed=7, difficulty=d) != generate(task, 50, seed=8, difficulty=d)
    # A prefix of a longer run is the shorter run: one rng drives the whole list.
    assert generate(task, 10, seed=7, difficulty=d) == generate(task, 50, seed=7, difficulty=d)[:10]


def test_drawn_sets_are_cached_as_drawn() -> None:
    """A run draws the same sets several times; the cache hands each caller its own list, and
    a mixture's order (which sets each draw's level) is part of the key."""
    first = generate("arith", 30, seed=5, difficulty={1: 0.5, 4: 0.5})
    first.clear()
    again = generate("arith", 30, seed=5, difficulty={1: 0.5, 4: 0.5})
    assert len(again) == 30
    assert again != generate("arith", 30, seed=5, difficulty={4: 0.5, 1: 0.5})


def test_global_rng_untouched() -> None:
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate("countdown", 20, seed=0, difficulty=5)
    assert random.random() == expected


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="arith.*countdown"):
        generate("sudoku", 1, seed=0, difficulty=1)


@pytest.mark.parametrize(
    ("task", "difficulty", "valid"),
    [
        ("arith", 0, "1..32"),
        ("arith", 33, "1..32"),
        ("countdown", 1, "2..5"),
        ("countdown", 6, "2..5"),
    ],
)
def test_bad_difficulty(task: str, difficulty: int, valid: str) -> None:
    with pytest.raises(ValueError, match=valid):
        generate(task, 0, seed=0, difficulty=difficulty)
    with pytest.raises(ValueError, match=valid):
        TASKS[task](random.Random(0), difficulty)


def test_difficulty_mixture_draws_each_level_with_its_weight() -> None:
    """{1: 0.95, 16: 0.05}: every problem has 1 or 16 operations, about 5% have 16 (binomial
    sd of 2000 draws at p=0.05 is 0.49 points), and the draw is deterministic."""
    problems = generate("arith", 2000, seed=3, difficulty={1: 0.95, 16: 0.05})
    ops = [p.prompt.count("+") + p.prompt.count("-") for p in problems]
    assert set(ops) == {1, 16}
    assert 0.035 < ops.count(16) / len(ops) < 0.065
    assert problems == generate("arith", 2000, seed=3, difficulty={1: 0.95, 16: 0.05})
    # worked solutions, the responses SFT teaches, differ in length about 10x
    lengths = sorted(len(p.solution) for p in problems)
    assert lengths[len(lengths) // 2] * 8 < lengths[int(0.99 * len(lengths))]
    with pytest.raises(ValueError, match="weights must be > 0"):
        generate("arith", 1, seed=0, difficulty={1: 1.0, 16: 0.0})


def test_negative_n() -> None:
    with pytest.raises(ValueError, match="n must be"):
        generate("arith", -1, seed=0, difficulty=1)
