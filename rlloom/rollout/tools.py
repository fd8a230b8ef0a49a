"""Tools a policy calls in a multi-turn rollout: the call format it writes, the built-in tools
(a calculator, Python in the sandbox) and the user's, and a runner that calls them
concurrently with a per-call timeout, giving an error string back instead of raising.

A model turn that ends with `</call>` is a call: `<call NAME>ARGS</call>` (format "tag") or
`<call>{"name": NAME, "arguments": ARGS}</call>` (format "json"). Its result is appended as
`<result>TEXT</result>`, a turn the model reads but is never trained on.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import rlloom.user_code as user_code
from rlloom.rewards.expr import ExprError, evaluate
from rlloom.rewards.sandbox import SandboxLimits, SandboxPool

CALL_END = "</call>"
RESULT = "<result>{}</result>"
_TAG = re.compile(r"<call ([A-Za-z_][\w.-]*)>(.*)</call>\s*$", re.S)
_JSON = re.compile(r"<call>(.*)</call>\s*$", re.S)

Tool = Callable[[str], Any]


class ToolError(ValueError):
    """A tool named in the config that cannot be used."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: str


@dataclass(frozen=True)
class ToolResult:
    text: str      # what the model reads back
    error: bool    # the call failed: malformed, unknown tool, raised, timed out
    seconds: float


def parse_call(text: str, fmt: str) -> ToolCall:
    """The call a turn's text ends with; ValueError naming what is wrong otherwise."""
    if fmt == "tag":
        m = _TAG.search(text)
        if m is None:
            raise ValueError("malformed tool call: write <call NAME>ARGS</call>")
        return ToolCall(m.group(1), m.group(2))
    m = _JSON.search(text)
    if m is None:
        raise ValueError('malformed tool call: write <call>{"name": ..., "arguments": ...}'
                         "</call>")
    try:
        body = json.loads(m.group(1))
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed tool call: not JSON ({e.msg})") from None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise ValueError('malformed tool call: give {"name": ..., "arguments": ...}')
    args = body.get("arguments", "")
    return ToolCall(body["name"], args if isinstance(args, str) else json.dumps(args))


def calculator(expression: str) -> str:
    """Exact arithmetic (+ - * / and parentheses on integers): an integer, or a fraction."""
    try:
        value = evaluate(expression.strip())
    except (ExprError, ZeroDivisionError) as e:
        raise ValueError(str(e) or "not an arithmetic expression") from None
    return str(value.numerator) if value.denominator == 1 else str(value)


class PythonTool:
    """The built-in ``python`` tool: what a program prints when run as a script in the
    sandbox (rewards/sandbox.py), with its own pool of one judge, started on first use."""

    LIMITS = SandboxLimits(wall_s=5.0, max_output_bytes=16_000)

    def __init__(self, isolation: str = "strict") -> None:
        self.isolation, self._pool, self._lock = isolation, None, threading.Lock()

    def __call__(self, code: str) -> str:
        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(1, self.LIMITS, self.isolation)
        result = self._pool.run_script(code)
        printed = (result.stdout + result.stderr).strip()
        if result.reason or result.exit:
            why = result.reason or f"exit code {result.exit}"
            raise RuntimeError(f"{why}; {printed[-300:]}".strip("; "))
        return printed


BUILT_IN: dict[str, Callable[[str], Tool]] = {"calculator": lambda _: calculator,
                                              "python": PythonTool}


def load_tools(specs: list[str], isolation: str = "strict") -> dict[str, Tool]:
    """Name -> function of each tool in `specs`: a built-in name, or a resolved
    `module:function` / `file.py:function` spec named by its function. `isolation` is the
    sandbox's for the ``python`` tool (`reward.sandbox_isolation`)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if spec in BUILT_IN:
            name, fn = spec, BUILT_IN[spec](isolation)
        else:
            name, fn = user_code.load(spec, "tool", ToolError)
        if name in tools:
            raise ToolError(f"rollout.tools names {name!r} twice")
        tools[name] = fn
    return tools


class Pending:
    """One tool call in flight: `done()` once it answered or ran out of time, `result()` its
    result (waiting for it if need be)."""

    def __init__(self, call: ToolCall, timeout_s: float, result: ToolResult | None = None
                 ) -> None:
        self.call, self.timeout_s = call, timeout_s
        self.deadline = time.perf_counter() + timeout_s
        self._result = result
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        return (self._result is not None or not self._thread.is_alive()
                or time.perf_counter() >= self.deadline)

    def wait(self, seconds: float) -> None:
        """Block up to `seconds` (never past the deadline) for the call to answer."""
        if self._thread is not None:
            self._thread.join(max(0.0, min(seconds, self.deadline - time.perf_counter())))

    def result(self) -> ToolResult:
        self.wait(self.timeout_s)
        if self._result is None:  # still running: abandoned, the daemon thread left behind
            self._result = ToolResult(f"error: tool {self.call.name!r} took longer than "
                                      f"{self.timeout_s:g} s", True, self.timeout_s)
        return self._result


class ToolRunner:
    """Calls tools, each in a daemon thread given `timeout_s` (a hung tool is abandoned, never
    waited on at exit), and returns each call's result text, at most `max_chars` long;
    failures come back as error text for the model to read."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_chars: int) -> None:
        self.tools, self.timeout_s, self.max_chars = tools, timeout_s, max_chars

    def start(self, call: ToolCall | str) -> Pending:
        """Start one call (a string is a parse error to give back) and return at once."""
        if isinstance(call, str):
            return Pending(ToolCall("", ""), self.timeout_s,
                           ToolResult(f"error: {call}", True, 0.0))
        fn = self.tools.get(call.name)
        if fn is None:
            return Pending(call, self.timeout_s, ToolResult(
                f"error: unknown tool {call.name!r}; tools are {', '.join(self.tools)}",
                True, 0.0))
        pending = Pending(call, self.timeout_s)
        pending._thread = threading.Thread(target=self._call, args=(fn, pending), daemon=True,
                                           name=f"rlloom-tool-{call.name}")
        pending._thread.start()
        return pending

    def run(self, calls: list[ToolCall | str]) -> list[ToolResult]:
        """The results of `calls`, run concurrently, in their order."""
        return [p.result() for p in [self.start(c) for c in calls]]

    def _call(self, fn: Tool, pending: Pending) -> None:
        start = time.perf_counter()
        try:
            out = fn(pending.call.args)
            if inspect.isawaitable(out):
                out = asyncio.run(out)
            text, error = str(out), False
        except Exception as e:  # noqa: BLE001 - the tool's error goes back to the model
            text, error = f"error: {type(e).__name__}: {e}", True
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"...[{len(text) - self.max_chars} more characters]"
        if pending._result is None:  # not already timed out
            pending._result = ToolResult(text, error, time.perf_counter() - start)
