"""Final-answer extraction and equivalence checking for math reasoning rewards.

Equivalence is delegated to math-verify (sympy based), which can take unbounded time on
adversarial answers such as ``10^{10^{10}}``. math-verify's own timeout uses ``signal.alarm``,
which only has whole-second resolution and raises when used off the main thread, so it is
disabled here and every check runs under our own deadline instead:

* main thread, no interval timer already running: ``signal.setitimer`` interrupts the check
  itself, so nothing is left running afterwards;
* anywhere else (worker threads, or a caller that owns ``ITIMER_REAL``): the check runs in a
  reusable worker process that is killed if it overruns (see ``bounded``). A thread would not
  do: a long C-level integer operation holds the GIL, so the waiting thread could not wake.
  This costs an IPC round trip per check, and a worker start (an interpreter plus imports,
  not counted against ``timeout_s``) the first time and after every timeout.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rlloom.rewards.bounded import WorkerPool

# Longer "answers" are almost always runaway generations; parsing them only burns the budget.
_MAX_ANSWER_CHARS = 1000
_POOL = WorkerPool()

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
# A period ends the sentence only when followed by whitespace or the end, so 3.5 survives.
_ANSWER_IS_RE = re.compile(
    r"the\s+(?:final\s+)?answer\s+is\s*:?[ \t]*(.+?)[ \t]*(?:\.(?=\s|$)|$)",
    re.IGNORECASE | re.MULTILINE,
)


class _NoTimeoutWarning(logging.Filter):
    """Drops math-verify's warning that its own timeout is off: ours replaces it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


@dataclass(frozen=True)
class MathScore:
    reward: float
    correct: bool
    formatted: bool
    reason: str | None


def _braced(text: str, open_at: int) -> str | None:
    """Contents of the brace group opening at ``text[open_at]``, or None if never closed."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def _last_boxed(response: str) -> str | None:
    for match in reversed(list(_BOX_RE.finditer(response))):
        content = _braced(response, match.end() - 1)
        # A truncated final box should not hide an earlier complete one.
        if content is not None and content.strip():
            return content.strip()
    return None


def _strip_math_delimiters(answer: str) -> str:
    answer = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(
            right
        ):
            return answer[len(left) : -len(right)].strip()
    return answer


def extract_answer(response: str) -> str | None:
    """The final answer in ``response``, or None if it states none.

    Tried in order: the last ``\\boxed{...}``/``\\fbox{...}`` (balanced braces), the last
    GSM8K-style ``#### n`` line, the last "the answer is ..." up to the end of the sentence
    or line.
    """
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES_RE, _ANSWER_IS_RE):
        matches = pattern.findall(response)
        if matches:
            answer = _strip_math_delimiters(matches[-1])
            if answer:
                return answer
    return None


class _Deadline(BaseException):
    """Raised by the alarm handler; a BaseException so math-verify's ``except Exception``
    blocks cannot swallow it."""


def _with_alarm(check: Callable[[], bool], timeout_s: float) -> bool:
    armed = True

    def on_alarm(signum: int, frame: object) -> None:
        # The handler can still run just after the check finished; it must not fire then.
        if armed:
            raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return check()
        finally:
            armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return False
    finally:
        signal.signal(signal.SIGALRM, previous)


def _can_use_alarm() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )


@functools.cache
def _math_verify() -> tuple:
    """math-verify's parse, verify and extraction settings, imported on the first check: the
    import (sympy, latex2sympy) costs ~0.3 s that runs without a math task never need."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    return parse, verify, (LatexExtractionConfig(), ExprExtractionConfig())


def _parse(answer: str) -> list:
    parse, _, extraction = _math_verify()
    return parse(f"${_strip_math_delimiters(answer)}$", extraction, parsing_timeout=None)


def _equivalent(predicted: str, reference: str) -> bool:
    gold = _parse(reference)
    target = _parse(predicted)
    if not gold or not target:
        return False
    return _math_verify()[1](gold, target, timeout_seconds=None)


def answers_equal(predicted: str, reference: str, timeout_s: float = 2.0) -> bool:
    """Whether ``predicted`` is mathematically equivalent to ``reference`` per math-verify.

    Handles fractions vs decimals, LaTeX variants, sets, intervals, percentages and
    thousands separators. Never raises; returns False on timeout or unparsable input.
    """
    predicted, reference = predicted.strip(), reference.strip()
    if not predicted or not reference:
        return False
    if len(predicted) > _MAX_ANSWER_CHARS or len(reference) > _MAX_ANSWER_CHARS:
        return False
    if timeout_s <= 0:
        return False

    def check() -> bool:
        return _equivalent(predicted, reference)

    try:
        if _can_use_alarm():
            return _with_alarm(check, timeout_s)
        return bool(_POOL.call(_equivalent, (predicted, reference), timeout_s))
    except Exception:
        return False


def score_math(
    response: str, reference: str, format_weight: float = 0.0, timeout_s: float = 2.0
) -> MathScore:
    """Reward for a full model response: ``1.0 * correct + format_weight * formatted``."""
    answer = extract_answer(response)
    if answer is None:
        return MathScore(reward=0.0, correct=False, formatted=False, reason="no final answer")
    correct = answers_equal(answer, reference, timeout_s=timeout_s)
    reason = None if correct else "wrong or unverifiable answer"
    return MathScore(
        reward=float(correct) + format_weight, correct=correct, formatted=True, reason=reason
    )
