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

from rlloom import user_code
from rlloom.rewards.expr import ExprError, evaluate
from rlloom.rewards.sandbox import SandboxLimits, run_program

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


def python(code: str) -> str:
    """What the program prints, run in the sandbox with its limits (rewards/sandbox.py)."""
    result = run_program(code, [], SandboxLimits(wall_s=5.0, max_output_bytes=16_000))
    if result.reason:
        raise RuntimeError(f"{result.reason}; {result.output.strip()[-300:]}".strip("; "))
    return result.output.strip()


BUILT_IN: dict[str, Tool] = {"calculator": calculator, "python": python}


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """Name -> function of each tool in `specs`: a built-in name, or a resolved
    `module:function` / `file.py:function` spec named by its function."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        if spec in BUILT_IN:
            name, fn = spec, BUILT_IN[spec]
        else:
            name, fn = user_code.load(spec, "tool", ToolError)
        if name in tools:
            raise ToolError(f"rollout.tools names {name!r} twice")
        tools[name] = fn
    return tools


class ToolRunner:
    """Calls tools concurrently, each in a daemon thread given `timeout_s` (a hung tool is
    abandoned, never waited on at exit), and returns each call's result text, at most
    `max_chars` long; failures come back as error text for the model to read."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_chars: int) -> None:
        self.tools, self.timeout_s, self.max_chars = tools, timeout_s, max_chars

    def run(self, calls: list[ToolCall | str]) -> list[ToolResult]:
        """Results in the order of `calls`; a string in `calls` is a parse error to return."""
        slots: list[ToolResult | None] = [None] * len(calls)
        threads = []
        t0 = time.perf_counter()
        for i, call in enumerate(calls):
            if isinstance(call, str):
                slots[i] = ToolResult(f"error: {call}", True, 0.0)
                continue
            fn = self.tools.get(call.name)
            if fn is None:
                slots[i] = ToolResult(f"error: unknown tool {call.name!r}; tools are "
                                      f"{', '.join(self.tools)}", True, 0.0)
                continue
            thread = threading.Thread(target=self._call, args=(fn, call, slots, i),
                                      daemon=True, name=f"rlloom-tool-{call.name}")
            thread.start()
            threads.append((i, call, thread))
        for i, call, thread in threads:
            thread.join(max(0.0, self.timeout_s - (time.perf_counter() - t0)))
            if thread.is_alive():
                slots[i] = ToolResult(f"error: tool {call.name!r} took longer than "
                                      f"{self.timeout_s:g} s", True, self.timeout_s)
        return [s for s in slots if s is not None]

    def _call(self, fn: Tool, call: ToolCall, slots: list[ToolResult | None], i: int) -> None:
        start = time.perf_counter()
        try:
            out = fn(call.args)
            if inspect.isawaitable(out):
                out = asyncio.run(out)
            text, error = str(out), False
        except Exception as e:  # noqa: BLE001 - the tool's error goes back to the model
            text, error = f"error: {type(e).__name__}: {e}", True
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"...[{len(text) - self.max_chars} more characters]"
        if slots[i] is None:  # not already timed out
            slots[i] = ToolResult(text, error, time.perf_counter() - start)
