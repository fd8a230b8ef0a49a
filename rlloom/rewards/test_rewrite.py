"""Tests rewritten so a candidate program cannot forge their outcome.

`assert EXPR == LITERAL` (or `!=`, either side the literal) becomes a report of EXPR's
value: the sandboxed process computes the value and sends it back as plain data, and the host
compares it with the literal, which never enters the candidate's process. A program that
fakes results (always-equal objects, patched builtins, frame walking, writing the result
channel itself) therefore has to know the expected values to pass, that is, solve the task.

Other asserts (`assert abs(f(x) - y) < 1e-6`, computed expectations) run in the candidate's
process as before, with `==` and `!=` made strict: both sides must be plain builtin data
(`plain`), so always-equal objects fail them; a program that walks the harness's frames can
still bend these, which docs/sandbox.md lists.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

REPORT = "__rlloom_report__"
STRICT_EQ = "__rlloom_eq__"


@dataclass(frozen=True)
class Expected:
    test: int        # which test
    index: int       # which value assert, counted over all tests
    equal: bool      # == (True) or != (False)
    value: Any       # the literal
    required: bool   # reached on every run (not under a loop, branch or handler)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


class _Rewriter(ast.NodeTransformer):
    def __init__(self, test: int, first: int) -> None:
        self.test, self.next, self.expected = test, first, []
        self.depth = 0  # inside a loop, branch, handler or nested function

    def _nested(self, node: ast.AST) -> ast.AST:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1
        return node

    visit_For = visit_While = visit_If = visit_Try = visit_With = _nested
    visit_AsyncFor = visit_AsyncWith = visit_Lambda = _nested

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        # a test's `def check(candidate)` runs when the test calls it: its straight-line
        # asserts are reached as surely as top-level ones
        self.generic_visit(node)
        return node

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0],
                                                                        (ast.Eq, ast.NotEq)):
            for expr, other in ((t.left, t.comparators[0]), (t.comparators[0], t.left)):
                ok, value = _literal(other)
                if ok and not _literal(expr)[0]:
                    self.expected.append(Expected(self.test, self.next,
                                                  isinstance(t.ops[0], ast.Eq), value,
                                                  self.depth == 0))
                    call = ast.Call(ast.Name(REPORT, ast.Load()),
                                    [ast.Constant(self.next), expr], [])
                    self.next += 1
                    return ast.copy_location(ast.Expr(call), node)
        return _Strict().visit(node)


class _Strict(ast.NodeTransformer):
    """`a == b` -> `__rlloom_eq__(a, b)`, `a != b` -> `not __rlloom_eq__(a, b)`."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        call = ast.Call(ast.Name(STRICT_EQ, ast.Load()), [node.left, node.comparators[0]], [])
        out = call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
        return ast.copy_location(out, node)


def rewrite(tests: list[str]) -> tuple[list[str], list[Expected]]:
    """The tests as the sandboxed process runs them, and the expected values the host keeps.
    A test that does not parse is kept as it is (it fails in the sandbox, as before)."""
    out, expected = [], []
    for i, source in enumerate(tests):
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            out.append(source)
            continue
        rewriter = _Rewriter(i, len(expected))
        tree = ast.fix_missing_locations(rewriter.visit(tree))
        out.append(ast.unparse(tree))
        expected += rewriter.expected
    return out, expected


def decode(value: Any) -> Any:
    """Plain data as the sandbox tags it (see the harness's `_plain`) back to Python values."""
    kind, body = value[0], value[1:]
    if kind in ("i", "s", "b"):
        return body[0]
    if kind == "f":
        return float(body[0])
    if kind == "n":
        return None
    items = [decode(v) for v in body[0]]
    return {"l": list, "t": tuple, "S": frozenset}[kind](items) if kind != "d" else \
        dict(zip(items[0::2], items[1::2]))


def judge(expected: list[Expected], tests: int, completed: list[bool],
          reports: list[tuple[int, Any]]) -> list[bool]:
    """Which tests pass: each ran to its end in the sandbox, every value it reported equals
    (or, for `!=`, differs from) the literal, and every value assert it reaches on every run
    reported at least once."""
    by_index = {e.index: e for e in expected}
    passed = list(completed) + [False] * (tests - len(completed))
    seen = set()
    for index, raw in reports:
        e = by_index.get(index)
        if e is None:
            continue
        seen.add(index)
        try:
            got = decode(raw)
        except (IndexError, KeyError, TypeError, ValueError):
            passed[e.test] = False
            continue
        if (got == e.value) != e.equal:
            passed[e.test] = False
    for e in expected:
        if e.required and e.index not in seen:
            passed[e.test] = False
    return passed[:tests]
