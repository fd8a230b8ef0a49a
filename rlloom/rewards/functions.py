"""Reward functions written in Python by the user, called the way TRL calls them:

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float]

`prompts` and `completions` hold one entry per sample: strings, or for a chat prompt its turns
and the completion as `[{"role": "assistant", "content": text}]`; `completion_ids` the
response token ids, and every other column of the dataset row (`answer`, and the prompt
file's own columns) comes as a keyword argument holding one value per sample. A function may
be `async`. Each is named by its function name, logged as `reward/<name>` and weighted by
`reward.weights[name]`.

A function is given as `module.path:function` or `path/to/file.py:function` (see
`rlloom.user_code`).

In the wild a function may hang, fail now and then (a rate-limited API) or return strings.
Each call gets `reward.timeout_s` (it runs in a thread; one that overruns is left behind and
the run stops naming it); a call that raises is retried `reward.retries` times, the batch
whole, before the samples are tried one by one to name the one it fails on; and only real
numbers (int, float, bool, numpy and 0-d torch scalars) are accepted, never numeric strings.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rlloom.user_code as user_code

RewardFn = Callable[..., Any]


class RewardFunctionError(user_code.UserCodeError):
    """A user reward function that cannot be loaded, raised, or returned something unusable."""


def resolve_spec(spec: str, base: Path) -> str:
    """`spec` with a relative file path made absolute against `base`."""
    return user_code.resolve_spec(spec, base, "reward function", RewardFunctionError)


def load(spec: str) -> tuple[str, RewardFn]:
    """(name, function) of a resolved spec, whose signature takes TRL's arguments."""
    name, fn = user_code.load(spec, "reward function", RewardFunctionError)
    _takes_trl_arguments(name, fn)
    return name, fn


def _takes_trl_arguments(name: str, fn: RewardFn) -> None:
    """Refuses, before any work, a function that cannot be called as TRL calls it: by the
    keywords prompts, completions, completion_ids and the rows' other columns."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: found at its first call
        return
    keywords = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [a for a in ("prompts", "completions", "completion_ids")
               if a not in named and not keywords]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if missing or positional:
        raise RewardFunctionError(
            f"reward function {name!r} cannot take TRL's arguments ({', '.join(missing or positional)}"
            f" {'missing' if missing else 'positional-only'}); define it as "
            f"def {name}(prompts, completions, **kwargs) (the row's other columns, "
            "completion_ids among them, arrive as keywords)")


_RETRY_WAIT_S = 0.5  # before the first retry; doubled for each next one


def _within(seconds: float, what: Callable[[], Any], name: str, n: int) -> Any:
    """`what()` in a daemon thread, waited on for `seconds` at most."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = what()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    thread = threading.Thread(target=target, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RewardFunctionError(f"reward function {name!r} took longer than {seconds:g} s on "
                                  f"a batch of {n} (reward.timeout_s); make it faster or raise "
                                  "reward.timeout_s")
    if "error" in out:
        error = out["error"]
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt: the user's code
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}({error}) on a batch of "
                f"{n}; a reward function returns its rewards, it must not exit or interrupt "
                "the run") from None
        raise error
    return out["value"]


def _number(value: Any) -> float | None:
    """A real number as float; None for anything else (strings, None, lists, complex)."""
    if hasattr(value, "dtype") and tuple(getattr(value, "shape", (1,))) == ():
        value = value.item()  # numpy and 0-d torch scalars
    return float(value) if isinstance(value, numbers.Real) else None


def call(name: str, fn: RewardFn, prompts: list[Any], completions: list[Any],
         completion_ids: list[list[int]], columns: dict[str, list[Any]],
         sources: list[str], timeout_s: float = 300.0, retries: int = 2) -> list[float]:
    """The function's rewards for a batch, checked: one real number per sample (a NaN or an
    infinity is named here, and the step's non-finite guard, `train.on_nonfinite`, stops
    the run or drops the update). A
    call that raises is retried `retries` times; if it still raises, the samples are tried
    one by one to name the first one it fails on."""
    def run(idx: list[int]) -> Any:
        def once() -> Any:
            out = fn(prompts=[prompts[i] for i in idx],
                     completions=[completions[i] for i in idx],
                     completion_ids=[completion_ids[i] for i in idx],
                     **{k: [v[i] for i in idx] for k, v in columns.items()})
            return asyncio.run(out) if inspect.isawaitable(out) else out
        return _within(timeout_s, once, name, len(idx))

    n = len(completions)
    try:  # a call its signature cannot take fails every time: said at once, never retried
        inspect.signature(fn).bind(prompts=prompts, completions=completions,
                                   completion_ids=completion_ids, **columns)
    except TypeError as e:
        raise RewardFunctionError(
            f"reward function {name!r} cannot be called with this data's columns "
            f"({', '.join(['prompts', 'completions', 'completion_ids', *columns])}): {e}; add "
            "**kwargs to its parameters") from None
    except ValueError:  # no signature to read (a builtin): its first call says
        pass
    for attempt in range(retries + 1):
        try:
            values = run(list(range(n)))
            break
        except RewardFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - maybe transient: retried, then pinned down
            if attempt < retries:
                time.sleep(_RETRY_WAIT_S * 2 ** attempt)
                continue
            for i in range(n):
                try:
                    run([i])
                except RewardFunctionError:
                    raise
                except Exception as one:  # noqa: BLE001
                    raise RewardFunctionError(
                        f"reward function {name!r} raised {type(one).__name__}: {one} on "
                        f"sample {i}{_where(sources[i])} (completion {completions[i][:80]!r}), "
                        f"{retries + 1} times on its batch") from one
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(e).__name__}: {e} on a batch of {n} "
                f"{retries + 1} times, though on no sample alone") from e
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function {name!r} must return a list of numbers, "
                                  f"one per completion; got {str(values)[:120]}")
    numbers_ = [_number(v) for v in values]
    wrong = next((i for i, v in enumerate(numbers_) if v is None), None)
    if wrong is not None:
        raise RewardFunctionError(
            f"reward function {name!r} must return a list of numbers, one per completion; got "
            f"{values[wrong]!r} ({type(values[wrong]).__name__}) for sample {wrong}"
            f"{_where(sources[wrong]) if wrong < n else ''}")
    values = numbers_
    if len(values) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for "
                                  f"{n} completions; return one per completion")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:  # the step's non-finite guard decides (train.on_nonfinite)
        print(f"reward function {name!r} returned {values[bad]} for sample {bad}"
              f"{_where(sources[bad])}", file=sys.stderr)
    return values


def _where(source: str) -> str:
    return f" ({source})" if source else ""
