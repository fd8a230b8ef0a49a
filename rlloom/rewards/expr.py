"""Safe exact evaluation of arithmetic written by a model.

Only decimal int literals, binary + - * /, unary minus and parentheses are
accepted; the expression is parsed with ``ast`` and walked by hand, never run.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction
from itertools import accumulate

_MAX_LEN = 200
# The walk below recurses once per level, so depth must be bounded explicitly.
_MAX_DEPTH = 100
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class ExprError(ValueError):
    """The expression is not an accepted arithmetic expression."""


def _parse(expr: str, max_len: int) -> ast.expr:
    if len(expr) > max_len:
        raise ExprError(f"expression longer than {max_len} characters")
    text = expr.strip()  # leading spaces would be an IndentationError
    depths = accumulate(1 if c == "(" else -1 if c == ")" else 0 for c in text)
    if max(depths, default=0) > _MAX_DEPTH:
        raise ExprError(f"parentheses nested deeper than {_MAX_DEPTH}")
    try:
        tree = ast.parse(text, mode="eval").body
    # CPython's parser itself can give up on pathological input with these.
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ExprError(f"invalid syntax: {e}") from None
    for node in ast.walk(tree):
        # 0x10, 1_000 and 0o7 are ints to Python but not numbers a model should write.
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literal = ast.get_source_segment(text, node) or ""
            if not (literal.isascii() and literal.isdigit()):
                raise ExprError(f"non-decimal integer literal {literal!r}")
    return tree


def _eval(node: ast.expr, depth: int) -> Fraction:
    if depth > _MAX_DEPTH:
        raise ExprError(f"expression nested deeper than {_MAX_DEPTH}")
    if isinstance(node, ast.Constant):
        # type() rather than isinstance(): True/False are ints too.
        if type(node.value) is not int:
            raise ExprError(f"unsupported constant {node.value!r}")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub):
            raise ExprError(f"unsupported operator {type(node.op).__name__}")
        return -_eval(node.operand, depth + 1)
    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ExprError(f"unsupported operator {type(node.op).__name__}")
        left = _eval(node.left, depth + 1)
        right = _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ExprError("division by zero")
        return op(left, right)
    raise ExprError(f"unsupported syntax {type(node).__name__}")


def evaluate(expr: str, max_len: int = _MAX_LEN) -> Fraction:
    """Exact value of ``expr``; raises ExprError for anything not accepted."""
    return _eval(_parse(expr, max_len), 0)


def numbers_used(expr: str) -> list[int]:
    """Sorted integer literals of ``expr`` (a negated literal counts as itself)."""
    tree = _parse(expr, _MAX_LEN)
    _eval(tree, 0)  # same acceptance rules as evaluate()
    return sorted(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant))
