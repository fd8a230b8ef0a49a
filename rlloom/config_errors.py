"""Configuration errors a user reads: each problem on a line, an unknown key with the key it
most likely meant (TRL's and verl's names with rlloom's, `rlloom/trl_names.py`)."""
from __future__ import annotations

import difflib
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

import rlloom.trl_names as trl_names


class ConfigError(ValueError):
    pass


def _closest(key: str, options: list[str]) -> str:
    prefix, _, name = key.rpartition(".")
    if trl_names.rlloom_key(name):
        return f"; rlloom calls it {trl_names.rlloom_key(name)!r}"
    if name in trl_names.REFUSED:
        return f"; that is TRL's: {trl_names.REFUSED[name]}"
    if name in trl_names.POINTERS:
        return f"; rlloom's is {trl_names.POINTERS[name]}"
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if match:
        return f"; did you mean {'.'.join(filter(None, [prefix, match[0]]))!r}?"
    return f"; valid keys here: {', '.join(options)}"


def _section_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic class that holds the key at `loc` (None when it is inside a dict)."""
    cls: type[BaseModel] = root
    parts = list(loc[:-1])
    while parts:
        field = cls.model_fields.get(str(parts.pop(0)))
        ann = field.annotation if field else None
        if get_origin(ann) is dict:  # e.g. plan.layouts.<role>: skip the dict key
            ann = get_args(ann)[1]
            parts = parts[1:]
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def explain(err: ValidationError, source: str, root: type[BaseModel]) -> ConfigError:
    """One line per problem of `err`, unknown keys with a pointer to the right one."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            section = _section_at(e["loc"], root)
            hint = _closest(key, list(section.model_fields)) if section else ""
            lines.append(f"unknown key {key!r}{hint}")
        elif key:
            lines.append(f"{key}: {e['msg'].removeprefix('Value error, ')} "
                         f"(got {e.get('input')!r})")
        else:
            lines.append(e["msg"].removeprefix("Value error, "))
    return ConfigError(f"invalid configuration from {source}:\n  " + "\n  ".join(lines))
