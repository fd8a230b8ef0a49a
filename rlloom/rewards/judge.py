"""The judge: runs a program's tests with the program in a box (``box.py``), never in its own
process. Run by ``SandboxPool`` as ``python -m rlloom.rewards.judge ISOLATION``, one job per
line on stdin, one result per line on stdout.

Assert tests (trusted, like a reward function: they come from the user's dataset) run here,
in the judge's memory. The program's top-level functions and classes appear in the tests'
scope as proxies: calling one sends its arguments to the box as plain data, and the result
comes back as plain data of exact builtin types (anything else fails that call), so every
assert shape is judged on real values here: literal or computed sides, tolerances, ``in``,
loops over cases, helper functions, expected exceptions (re-raised here by type name, under
the nearest builtin base). A call that returns None (an in-place function) copies its
mutated arguments back into the caller's objects; a call that returns a value changes
nothing of the caller's. Stdin/stdout tests run the whole program once per case in the box
and compare its output here. The program never sees the tests, the expected values or this
process's memory.
"""

from __future__ import annotations

import builtins
import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import asdict
from typing import Any

from rlloom.rewards.box import Box, BoxConfig, BoxDied, SandboxLimits
from rlloom.rewards.box_files import Visible
from rlloom.rewards.box_server import MAX_ITEMS, NotPlain, decode, encode
from rlloom.rewards.cgroups import BoxCgroup


class ProgramError(Exception):
    """The program's call raised an exception whose type has no builtin base, or it answered
    something that is not plain data."""


# Exceptions that end the judge's own loops early, whatever raised them: a program's
# StopIteration would end `map`, `zip` or `all(...)` over its results as if every case passed.
_STEERING = (StopIteration, StopAsyncIteration)


def _exception(raised: Any, types: dict[tuple[str, str], type]) -> BaseException:
    """The exception the box reported ([type name, builtin base name, message]) as an
    instance of a class of that name deriving from that base (never a BaseException that is
    not an Exception: a program's SystemExit must not stop the judge; never a StopIteration:
    a ProgramError instead). ``types`` keeps the classes made for one program."""
    try:
        name, base_name, message = (str(x)[:2000] for x in raised)
    except (TypeError, ValueError):
        return ProgramError("malformed exception report")
    base = getattr(builtins, base_name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(base, _STEERING):
        base = ProgramError
    key = (name, base.__name__)
    if key not in types:
        types[key] = type(name, (base,), {"__module__": "solution"})
    return types[key](message)


def _sync(original: object, mutated: object) -> None:
    """Copies an in-place function's changes back into the caller's container."""
    if type(original) is list and type(mutated) is list:
        original[:] = mutated
    elif type(original) in (dict, set) and type(original) is type(mutated):
        original.clear()
        original.update(mutated)


class _Session:
    """The program loaded in one box: its names as proxies, and the calls into it."""

    def __init__(self, box: Box) -> None:
        self.box = box
        self.refs: dict[int, list] = {}
        self._keep: list = []  # proxies stay alive while their id() is a key of refs
        self.raised_types: dict[tuple[str, str], type] = {}

    def proxy(self, tag: list) -> object:
        made = _Function(self, tag) if tag[0] in ("f", "m") else _Instance(self, tag[1])
        self.refs[id(made)] = ["r", tag[1]] if tag[0] == "f" else ["h", tag[1]]
        self._keep.append(made)
        return made

    def resolve(self, tag: list) -> object:
        if tag[0] != "h" or type(tag[1]) is not int:
            raise ValueError("malformed value")
        return self.proxy(tag)

    def call(self, target: list, args: tuple, kwargs: dict) -> object:
        try:
            sent_args = [encode(a, self.refs) for a in args]
            sent_kwargs = {k: encode(v, self.refs) for k, v in kwargs.items()}
        except (NotPlain, RecursionError) as e:
            raise TypeError(f"the sandbox passes plain data only: {e}") from None
        reply = self.box.request({"op": "call", "target": target, "args": sent_args,
                                  "kwargs": sent_kwargs})
        if "raised" in reply:
            raise _exception(reply["raised"], self.raised_types)
        try:
            value = decode(reply.get("value"), self.resolve)
            mutated = [decode(a) for a in reply["args"]] if value is None and \
                isinstance(reply.get("args"), list) else []
        except (ValueError, TypeError, RecursionError, OverflowError):
            raise ProgramError("the program answered something that is not plain data") \
                from None
        for original, changed in zip(args, mutated):
            _sync(original, changed)
        return value


class _Function:
    def __init__(self, session: _Session, target: list) -> None:
        self._session, self._target = session, target
        self.__name__ = str(target[-1])

    def __call__(self, *args: Any, **kwargs: Any) -> object:
        return self._session.call(self._target, args, kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__name__} in the sandbox>"


class _Instance:
    """An instance of one of the program's classes, living in the box; its methods are
    called there (``Solution().two_sum(...)``)."""

    def __init__(self, session: _Session, handle: int) -> None:
        self._session, self._handle = session, handle

    def __getattr__(self, name: str) -> _Function:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Function(self._session, ["m", self._handle, name])


def _judge_asserts(box: Box, code: str, tests: list[str]) -> tuple[list[bool], str | None]:
    reply = box.request({"op": "load", "code": code})
    if isinstance(reply.get("fail"), str):
        return [False] * len(tests), reply["fail"][:200]
    table = reply.get("names")
    if not isinstance(table, dict) or len(table) > MAX_ITEMS:
        raise BoxDied("malformed reply")
    session = _Session(box)
    names: dict[str, object] = {}
    for name, kind in table.items():
        if hasattr(builtins, name):
            continue  # the tests' abs, sorted or isinstance stay the real ones
        try:
            names[name] = session.proxy(["f", name]) if kind in ("function", "class") \
                else decode(kind)
        except (ValueError, TypeError, RecursionError, OverflowError):
            pass
    passed = []
    for i, test in enumerate(tests):
        scope = {"__name__": "__test__", "__builtins__": builtins, **names}
        try:
            exec(compile(test, f"<test {i}>", "exec"), scope)
            ok = True
        except (BoxDied, Exception):  # noqa: BLE001 - a failing test just doesn't count
            ok = False
        if box.reason:  # the box died inside the test, even if the test swallowed it
            passed += [False] * (len(tests) - i)
            return passed, box.reason
        passed.append(ok)
    return passed, None


_INTEGER = re.compile(r"[+-]?[0-9]+")


def same_output(got: str, expected: str, compare: str, tol: float) -> bool:
    """Whether a program's stdout matches the expected output: ``exact`` (line by line,
    trailing whitespace of each line and trailing blank lines ignored), ``tokens``
    (whitespace-separated tokens equal) or ``float`` (tokens equal, or both numbers within
    ``tol`` absolute or relative where either token is not an integer; two integers are
    compared exactly)."""
    if compare == "exact":
        def lines(text: str) -> list[str]:
            return [line.rstrip() for line in text.rstrip().splitlines()]
        return lines(got) == lines(expected)
    a, b = got.split(), expected.split()
    if len(a) != len(b):
        return False
    if compare == "tokens":
        return a == b
    for x, y in zip(a, b):
        if x == y:
            continue
        if _INTEGER.fullmatch(x) and _INTEGER.fullmatch(y):
            try:  # integers on both sides are compared exactly: 1000000001 is not 1e9
                if int(x) == int(y):
                    continue
            except ValueError:  # past Python's digit limit: different strings, so different
                pass
            return False
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=tol, abs_tol=tol):
            return False
    return True


def _run_main(box: Box, code: str, stdin: str) -> dict:
    left = max(box.deadline - time.monotonic(), 0.0)
    reply = box.request({"op": "main", "code": code, "stdin": stdin, "timeout_s": left,
                         "max_output": box.limits.max_output_bytes})
    if not (isinstance(reply.get("stdout"), str) and isinstance(reply.get("stderr"), str)
            and all(type(reply.get(k)) in (int, type(None)) for k in ("exit", "signal"))
            and all(type(reply.get(k, False)) is bool for k in ("timeout", "overflow"))):
        raise BoxDied("malformed reply")
    return reply


def _case_reason(reply: dict) -> str | None:
    if reply.get("timeout"):
        return "timeout"
    if reply.get("overflow"):
        return "output limit"
    if reply.get("signal"):
        return f"killed by signal {reply['signal']}"
    return None


def _judge_io(box: Box, code: str, cases: list[dict], compare: str,
              tol: float) -> tuple[list[bool], str | None]:
    passed, reason = [], None
    for i, case in enumerate(cases):
        try:
            reply = _run_main(box, code, case["input"])
        except BoxDied as e:
            return passed + [False] * (len(cases) - i), e.reason
        reason = reason or _case_reason(reply)
        passed.append(reply.get("exit") == 0 and not _case_reason(reply)
                      and same_output(reply["stdout"], case["output"], compare, tol))
    return passed, reason


def _parses(code: str) -> bool:
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


class Boxes:
    """Hands out boxes, keeping one spare started ahead; ended boxes are cleaned up after
    their result was sent (``reap``), so neither start-up nor clean-up waits in line."""

    def __init__(self, cfg: BoxConfig) -> None:
        self.cfg, self.spare, self.ended, self.count = cfg, None, [], 0

    def _new(self, limits: SandboxLimits) -> Box:
        self.count += 1
        return Box(self.cfg, limits, f"rlloom-box-{os.getpid()}-{self.count}")

    def take(self, limits: SandboxLimits) -> Box:
        box, self.spare = self.spare, None
        if box is None or box.limits != limits:
            if box is not None:
                self.end(box)
            box = self._new(limits)
        try:
            self.spare = self._new(limits)
        except OSError:
            pass  # this box's own start says why, if it fails too
        box.begin()
        return box

    def end(self, box: Box) -> None:
        box.kill()
        self.ended.append(box)

    def reap(self) -> None:
        for box in self.ended:
            box.close()
        self.ended.clear()

    def close(self) -> None:
        if self.spare is not None:
            self.end(self.spare)
        self.reap()


def run_job(job: dict, boxes: Boxes) -> dict:
    """One program: its tests judged (``asserts`` or ``io``), or it run once (``script``)."""
    limits = SandboxLimits(**job["limits"])
    code, kind = job["code"], job["kind"]
    tests = job.get("tests", [])
    if kind != "script" and not _parses(code):
        return {"passed": 0, "total": len(tests), "reason": "syntax error", "output": ""}
    try:
        box = boxes.take(limits)
    except OSError as e:
        return {"unavailable": str(e)}
    try:
        if kind == "script":
            try:
                reply = _run_main(box, code, job.get("stdin", ""))
                result = {"stdout": reply["stdout"], "stderr": reply["stderr"],
                          "exit": reply.get("exit"), "reason": _case_reason(reply)}
            except BoxDied as e:
                result = {"stdout": "", "stderr": "", "exit": None, "reason": e.reason}
        else:
            try:
                passed, reason = _judge_asserts(box, code, tests) if kind == "asserts" else \
                    _judge_io(box, code, tests, job["compare"], job["tol"])
            except BoxDied as e:
                passed, reason = [False] * len(tests), e.reason
            except Exception as e:  # noqa: BLE001 - a reply nothing above foresaw fails its
                # program, never the judge (which judges the next program)
                passed, reason = [False] * len(tests), f"malformed reply ({type(e).__name__})"
            result = {"passed": sum(passed), "total": len(tests), "reason": reason}
    finally:
        boxes.end(box)
    result["output"] = bytes(box.output).decode("utf-8", "replace")
    return result


JUDGE_MEMORY_MB = 1024  # the judge's own memory (its cgroup): the tests' values and replies
JUDGE_ADDRESS_SPACE_MB = 2048  # its soft RLIMIT_AS, in every isolation (libraries included)


def _bound_own_memory(isolation: str) -> None:
    """No reply can take more of the host than this: past it the judge fails the program
    (MemoryError) or is killed by its cgroup and replaced by the pool."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (JUDGE_ADDRESS_SPACE_MB << 20, hard))
    if isolation == "strict":
        own = BoxCgroup.create(f"rlloom-judge-{os.getpid()}", JUDGE_MEMORY_MB << 20, 64)
        own.join(os.getpid())


def main() -> None:
    # the job channel is the original stdin/stdout; what tests print goes nowhere
    jobs, results = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    try:
        cfg = BoxConfig.for_host(sys.argv[1], Visible.from_json(sys.argv[2])
                                 if len(sys.argv) > 2 else None)
        _bound_own_memory(cfg.isolation)
    except OSError as e:  # every job is answered with why, so the pool can refuse clearly
        for _ in jobs:
            results.write(json.dumps({"unavailable": str(e)}).encode() + b"\n")
            results.flush()
        return
    boxes = Boxes(cfg)
    try:
        for line in jobs:
            result = run_job(json.loads(line), boxes)
            results.write(json.dumps(result).encode() + b"\n")
            results.flush()
            boxes.reap()
    finally:
        boxes.close()


def job(kind: str, code: str, limits: SandboxLimits, **fields: Any) -> dict:
    """A job line for ``main``."""
    return {"kind": kind, "code": code, "limits": asdict(limits), **fields}


if __name__ == "__main__":
    main()
