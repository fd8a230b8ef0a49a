from fractions import Fraction

import pytest

from rlloom.rewards.expr import ExprError, evaluate, numbers_used


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("(3+5)*2/4", Fraction(4)),
        ("25+3", Fraction(28)),
        ("7/2", Fraction(7, 2)),
        ("1/3+1/6", Fraction(1, 2)),
        ("-(2-5)*-3", Fraction(-9)),
        ("10-4-3", Fraction(3)),  # left associative
        ("2+3*4", Fraction(14)),  # precedence
        (" 6*7 ", Fraction(42)),
    ],
)
def test_accepts(expr: str, value: Fraction) -> None:
    result = evaluate(expr)
    assert result == value and isinstance(result, Fraction)


@pytest.mark.parametrize(
    ("expr", "named"),
    [
        ("__import__('os')", "Call"),
        ("2**100", "Pow"),
        ("1.5", "1.5"),
        ("a+1", "Name"),
        ("(1", "syntax"),
        ("1/0", "division by zero"),
        ("(1-1)/(2-2)", "division by zero"),
        ("7//2", "FloorDiv"),
        ("7%2", "Mod"),
        ("+3", "UAdd"),
        ("True+1", "True"),
        ("'1'", "'1'"),
        ("0x10", "0x10"),
        ("1_000", "1_000"),
        ("1e3", "1000.0"),
        ("2j", "2j"),
        ("(1).real", "Attribute"),
        ("[1][0]", "Subscript"),
        ("1 if 1 else 2", "IfExp"),
        ("", "syntax"),
        ("1\x00", "syntax"),
    ],
)
def test_rejects(expr: str, named: str) -> None:
    with pytest.raises(ExprError, match=named.replace("(", r"\(")):
        evaluate(expr)


def test_expr_error_is_value_error() -> None:
    assert issubclass(ExprError, ValueError)


def test_too_long() -> None:
    expr = "1+" * 100 + "1"  # 201 chars
    with pytest.raises(ExprError, match="longer than 200"):
        evaluate(expr)
    assert evaluate(expr, max_len=201) == 101


def test_too_deep() -> None:
    with pytest.raises(ExprError, match="nested deeper"):
        evaluate("(" * 500 + "1" + ")" * 500, max_len=10_000)
    with pytest.raises(ExprError, match="nested deeper"):
        evaluate("-" * 500 + "1", max_len=10_000)
    with pytest.raises(ExprError):
        evaluate("-" * 100_000 + "1", max_len=1_000_000)
    assert evaluate("(" * 50 + "1" + ")" * 50) == 1


def test_numbers_used() -> None:
    assert numbers_used("(3+5)*2/4") == [2, 3, 4, 5]
    assert numbers_used("25+3") == [3, 25]
    assert numbers_used("7*7-7") == [7, 7, 7]
    assert numbers_used("-3+(3)") == [3, 3]
    with pytest.raises(ExprError):
        numbers_used("a+1")
