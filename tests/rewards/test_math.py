import threading
import time

import pytest

from rlloom.rewards.math import MathScore, answers_equal, extract_answer, score_math

# Finishes on its own after a few seconds with little memory, so an abandoned check is harmless.
SLOW = "7^{7^{8}}"


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("so the result is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1}, then \\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("final: $\\fbox{x^{2}}$", "x^{2}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{3} and then a truncated \\boxed{\\frac{1}{", "3"),
        ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### 1,000\n", "1,000"),
        ("The answer is 7.", "7"),
        ("so THE ANSWER IS: 3.5. Done.", "3.5"),
        ("Thus the final answer is $\\frac{3}{4}$.\nExtra text", "\\frac{3}{4}"),
        ("the answer is 2\nthe answer is -5", "-5"),
        ("#### 9\nThe answer is 8.", "9"),
        ("\\boxed{1}\n#### 2", "1"),
    ],
)
def test_extract_answer(response: str, answer: str) -> None:
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    "response",
    ["", "I think it is probably 42", "\\boxed{}", "\\boxed{unclosed", "####   \n", "garbage }{"],
)
def test_extract_answer_none(response: str) -> None:
    assert extract_answer(response) is None


EQUAL = [
    ("42", "42"),
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{3}{4}", "0.75"),
    ("\\frac12", "\\frac{1}{2}"),
    ("1/3", "\\frac{1}{3}"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),
    ("3\\sqrt{3}", "\\sqrt{27}"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("[0, 1)", "[0,1)"),
    ("(-\\infty, 2]", "(-\\infty,2]"),
    ("-3", "-3"),
    ("-\\frac{1}{4}", "-0.25"),
    ("1,000", "1000"),
    ("12,345,678", "12345678"),
    ("7.0", "7"),
    ("50\\%", "0.5"),
    ("10^{3}", "1000"),
    ("(x+1)^2", "x^2+2x+1"),
    ("\\pi", "\\pi"),
    ("\\infty", "\\infty"),
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),
    ("2\\pi", "\\pi \\cdot 2"),
]

NOT_EQUAL = [
    ("41", "42"),
    ("-3", "3"),
    ("(0,1)", "[0,1)"),
    ("[0,1]", "[0,1)"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("\\frac{1}{3}", "0.5"),
    ("0.333", "\\frac{1}{3}"),
    ("3.14159", "\\pi"),
    ("2.0001", "2"),
    ("1,001", "1000"),
    ("\\sqrt{3}", "\\sqrt{2}"),
    ("x^2", "(x+1)^2"),
    ("25\\%", "0.5"),
    ("", "1"),
    ("1", ""),
    ("   ", "1"),
    ("}{", "1"),
    ("\\frac{", "\\frac{1}{2}"),
    ("banana", "7"),
    ("\\boxed{", "0"),
]


@pytest.mark.parametrize(("predicted", "reference"), EQUAL)
def test_equal(predicted: str, reference: str) -> None:
    assert answers_equal(predicted, reference) is True


@pytest.mark.parametrize(("predicted", "reference"), NOT_EQUAL)
def test_not_equal(predicted: str, reference: str) -> None:
    assert answers_equal(predicted, reference) is False


def test_overlong_answer_is_rejected_without_parsing() -> None:
    assert answers_equal("1" + "+0" * 1000, "1") is False


def test_timeout_bounds_call_in_main_thread() -> None:
    start = time.perf_counter()
    assert answers_equal(SLOW, "5", timeout_s=0.3) is False
    assert time.perf_counter() - start < 1.5
    # The previous SIGALRM handler and timer are restored, so later checks still work.
    assert answers_equal("\\frac{1}{2}", "0.5") is True


def test_timeout_bounds_call_off_main_thread() -> None:
    out: dict[str, object] = {}

    def run() -> None:
        start = time.perf_counter()
        out["slow"] = answers_equal(SLOW, "5", timeout_s=0.3)
        out["elapsed"] = time.perf_counter() - start
        out["fast"] = answers_equal("\\frac{1}{2}", "0.5")

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(10)
    assert out["slow"] is False
    assert out["elapsed"] < 1.5
    assert out["fast"] is True


def test_score_correct_with_format_weight() -> None:
    score = score_math("We get \\boxed{\\frac{1}{2}}", "0.5", format_weight=0.1)
    assert score == MathScore(reward=1.1, correct=True, formatted=True, reason=None)


def test_score_wrong_but_formatted() -> None:
    score = score_math("#### 41", "42", format_weight=0.2)
    assert (score.reward, score.correct, score.formatted) == (0.2, False, True)
    assert score.reason


def test_score_no_answer() -> None:
    score = score_math("I am not sure.", "42", format_weight=0.5)
    assert (score.reward, score.correct, score.formatted) == (0.0, False, False)
    assert score.reason == "no final answer"


def test_score_default_weight_is_plain_correctness() -> None:
    assert score_math("The answer is 1,000.", "1000").reward == 1.0
    assert score_math("The answer is 999.", "1000").reward == 0.0
