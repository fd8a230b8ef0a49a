"""Reward functions written in Python by the user, called the way TRL calls them:

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float]

`prompts` and `completions` are strings (one per sample), `completion_ids` the response token
ids, and every other column of the dataset row (`answer`, and the prompt file's own columns)
comes as a keyword argument holding one value per sample. A function may be `async`. Each is
named by its function name, logged as `reward/<name>` and weighted by `reward.weights[name]`.

A function is given as `module.path:function` (imported) or `path/to/file.py:function`
(loaded from the file; relative paths are resolved when the config is read, so every worker of
a run, whatever its directory, loads the same file).
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[..., Any]


class RewardFunctionError(ValueError):
    """A user reward function that cannot be loaded, raised, or returned something unusable."""


def resolve_spec(spec: str, base: Path) -> str:
    """`spec` with a relative file path made absolute against `base` (module paths unchanged),
    checked to have the `where:function` form."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise RewardFunctionError(f"reward function {spec!r}: give it as module.path:function "
                                  "or path/to/file.py:function")
    if where.endswith(".py"):
        path = Path(where).expanduser()
        return f"{path if path.is_absolute() else (base / path).resolve()}:{name}"
    return spec


def function_name(spec: str) -> str:
    """The name a function is logged and weighted by: the part after the last colon."""
    return spec.rpartition(":")[2]


def load(spec: str) -> tuple[str, RewardFn]:
    """(name, function) of a resolved spec."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise RewardFunctionError(f"reward function {spec!r}: file {path} not found")
        module_name = f"rlloom_reward_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RewardFunctionError(f"reward function {spec!r}: cannot import {where!r} "
                                      f"({e}); is it installed or on PYTHONPATH?") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: {where} has no function {name!r}")
    return name, fn


def call(name: str, fn: RewardFn, prompts: list[str], completions: list[str],
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
