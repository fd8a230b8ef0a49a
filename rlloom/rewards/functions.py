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
"""
from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlloom import user_code

RewardFn = Callable[..., Any]


class RewardFunctionError(user_code.UserCodeError):
    """A user reward function that cannot be loaded, raised, or returned something unusable."""


def resolve_spec(spec: str, base: Path) -> str:
    """`spec` with a relative file path made absolute against `base`."""
    return user_code.resolve_spec(spec, base, "reward function", RewardFunctionError)


def load(spec: str) -> tuple[str, RewardFn]:
    """(name, function) of a resolved spec."""
    return user_code.load(spec, "reward function", RewardFunctionError)


def call(name: str, fn: RewardFn, prompts: list[Any], completions: list[Any],
         completion_ids: list[list[int]], columns: dict[str, list[Any]],
         sources: list[str]) -> list[float]:
    """The function's rewards for a batch, checked: one finite number per sample. If it
    raises, the samples are tried one by one to name the first one it fails on."""
    def run(idx: list[int]) -> Any:
        out = fn(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx],
                 completion_ids=[completion_ids[i] for i in idx],
                 **{k: [v[i] for i in idx] for k, v in columns.items()})
        return asyncio.run(out) if inspect.isawaitable(out) else out

    n = len(completions)
    try:
        values = run(list(range(n)))
    except Exception as batch_error:  # noqa: BLE001 - the user's code may raise anything
        for i in range(n):
            try:
                run([i])
            except Exception as e:  # noqa: BLE001
                raise RewardFunctionError(
                    f"reward function {name!r} raised {type(e).__name__}: {e} on sample {i}"
                    f"{_where(sources[i])} (completion {completions[i][:80]!r})") from e
        raise RewardFunctionError(f"reward function {name!r} raised {type(batch_error).__name__}"
                                  f": {batch_error} on a batch of {n}, though on no sample "
                                  "alone") from batch_error
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward function {name!r} must return a list of numbers, "
                                  f"one per completion; got {str(values)[:120]}") from None
    if len(values) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(values)} values for "
                                  f"{n} completions; return one per completion")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise RewardFunctionError(f"reward function {name!r} returned {values[bad]} for sample "
                                  f"{bad}{_where(sources[bad])}; rewards must be finite")
    return values


def _where(source: str) -> str:
    return f" ({source})" if source else ""
