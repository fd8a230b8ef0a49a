import random

import pytest

from rlloom.data.synthetic import Problem, generate
from rlloom.rewards.synthetic import Score, score

ARITH = Problem("Q:17+25-8=", "34", "17+25=42,42-8=34.A:34", {"expression": "17+25-8"})
NEG = Problem("Q:5-9+3=", "-1", "5-9=-4,-4+3=-1.A:-1", {"expression": "5-9+3"})
CD46 = Problem("C:3,7,25=46?", "46", "A:25+3*7", {"numbers": [3, 7, 25], "target": 46})
CD_DUP = Problem("C:4,4,2=4?", "4", "A:4*2-4", {"numbers": [4, 4, 2], "target": 4})


@pytest.mark.parametrize("task", ["arith", "countdown"])  # code is scored by the sandbox
def test_every_generated_solution_scores_full(task: str) -> None:
    lo, hi = {"arith": (1, 6), "countdown": (2, 5)}[task]
    for difficulty in range(lo, hi + 1):
        for p in generate(task, 200, seed=100 + difficulty, difficulty=difficulty):
            assert score(p, p.solution, task) == Score(1.0, True, True), p
            assert score(p, p.solution, task, format_weight=0.1).reward == pytest.approx(1.1)


@pytest.mark.parametrize(
    ("response", "correct", "formatted"),
    [
        ("17+25=42,42-8=34.A:34", True, True),
        ("A:34", True, True),
        ("A: 34 \n", True, True),
        ("A:12.A:34", True, True),  # the last A: counts
        ("A:34.A:12", False, True),
        ("A:35", False, True),
        ("A:+34", True, False),
        ("A:34.", False, False),
        ("A:3_4", False, False),
        ("A:\u0663\u0664", False, False),  # Arabic-Indic 34: int() would accept it
        ("34", False, False),
        ("A:", False, False),
        ("A:" + "9" * 10_000, False, True),
        ("", False, False),
    ],
)
def test_arith(response: str, correct: bool, formatted: bool) -> None:
    s = score(ARITH, response, "arith", format_weight=0.5)
    assert (s.correct, s.formatted) == (correct, formatted)
    assert s.reward == 1.0 * correct + 0.5 * formatted


def test_arith_negative_answer() -> None:
    assert score(NEG, NEG.solution, "arith") == Score(1.0, True, True)
    assert score(NEG, "A:1", "arith") == Score(0.0, False, True)


@pytest.mark.parametrize(
    ("problem", "response", "correct", "formatted"),
    [
        (CD46, "A:25+3*7", True, True),
        (CD46, "A:7*3+25", True, True),
        (CD46, "think: 3*7=21\nA: (25+(3*7)) ", True, True),
        (CD46, "A:(25+3)*7", False, True),  # 196: wrong value, right numbers
        (CD46, "A:25+21", False, True),  # 46 with numbers not given
        (CD46, "A:25+3*7+7-7", False, True),  # 7 used twice
        (CD46, "A:25+3*7+0", False, True),  # extra number
        (CD46, "A:25+3*7-1+1", False, True),
        (CD46, "A:46", False, True),
        (CD46, "25+3*7", False, False),  # missing A:
        (CD46, "A:25+3*7 so 46", False, False),
        (CD46, "A:25+3*7=46", False, False),
        (CD46, "A:__import__('os')", False, False),
        (CD46, "A:2**100", False, False),
        (CD46, "A:1/0", False, False),
        (CD46, "A:" + "(" * 500 + "46" + ")" * 500, False, False),
        (CD46, "A:", False, False),
        (CD46, "\x00\xff garbage A:A:A:", False, False),
        (CD_DUP, "A:4*2-4", True, True),  # the repeated 4 is used once per copy
        (CD_DUP, "A:4+2-2", False, True),  # 2 twice, 4 once
        (CD_DUP, "A:4*4/2-4", False, True),  # 4 three times
    ],
)
def test_countdown(problem: Problem, response: str, correct: bool, formatted: bool) -> None:
    s = score(problem, response, "countdown", format_weight=0.25)
    assert (s.correct, s.formatted) == (correct, formatted)
    assert s.reward == 1.0 * correct + 0.25 * formatted


def test_garbage_never_raises() -> None:
    rng = random.Random(0)
    alphabet = "A:0123456789+-*/() .\n=,x_'\"\\\x00é"
    for _ in range(2000):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for task, problem in (("arith", ARITH), ("countdown", CD46)):
            s = score(problem, response, task, format_weight=1.0)
            assert 0.0 <= s.reward <= 2.0
    assert score(CD46, "A:" * 1_000_000, "countdown").reward == 0.0


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="arith.*countdown"):
        score(ARITH, "A:34", "sudoku")
