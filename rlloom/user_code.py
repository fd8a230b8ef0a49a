"""User Python named in a config, as `module.path:function` (imported),
`path/to/file.py:function` (loaded from the file) or `path/to/fn.pkl:function` (a function
pickled by value, as `rlloom.train` stores callables). Relative file paths are resolved when
the config is read, so every worker of a run, whatever its directory, loads the same file."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


class UserCodeError(ValueError):
    """User code that cannot be loaded, raised, or returned something unusable."""


def resolve_spec(spec: str, base: Path, what: str,
                 error: type[Exception] = UserCodeError) -> str:
    """`spec` with a relative file path made absolute against `base` (module paths unchanged),
    checked to have the `where:function` form; `what` names it in errors."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise error(f"{what} {spec!r}: give it as module.path:function or "
                    "path/to/file.py:function")
    if where.endswith((".py", ".pkl")):
        path = Path(where).expanduser()
        return f"{path if path.is_absolute() else (base / path).resolve()}:{name}"
    return spec


def function_name(spec: str) -> str:
    """The part of a spec after its last colon."""
    return spec.rpartition(":")[2]


def load(spec: str, what: str, error: type[Exception] = UserCodeError
         ) -> tuple[str, Callable[..., Any]]:
    """(name, function) of a resolved spec."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".pkl"):
        import cloudpickle
        try:
            fn = cloudpickle.loads(Path(where).read_bytes())
        except FileNotFoundError:
            raise error(f"{what} {spec!r}: file {where} not found") from None
        except Exception as e:  # noqa: BLE001 - unpickling runs the user's code
            raise error(f"{what} {spec!r}: cannot unpickle ({type(e).__name__}: {e}); the "
                        "function needs the same Python and packages as when it was stored"
                        ) from None
        if not callable(fn):
            raise error(f"{what} {spec!r}: {where} holds no function")
        return name, fn
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise error(f"{what} {spec!r}: file {path} not found")
        module_name = f"rlloom_user_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except (Exception, SystemExit) as e:  # the user's module, run as it is imported
                del sys.modules[module_name]
                raise error(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: "
                            f"{e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise error(f"{what} {spec!r}: cannot import {where!r} ({e}); is it installed or "
                        "on PYTHONPATH?") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise error(f"{what} {spec!r}: {where} has no function {name!r}")
    return name, fn
