"""How a run writes its files: whole or not at all, and a failed write names its file.

A file is replaced atomically (written beside it, fsync'd, renamed over it), so a full disk or
a kill leaves the old file whole; a JSON-lines log gets one line per write, and a line a
failed write cut is cut back off, so the next line starts where it should. Every failure is an
OSError that carries the file's name (Python's own writes raise ENOSPC without one), which
`rlloom` turns into one line naming the file and the free space."""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Re-raises an OSError of the block with `path` as its file name when it has none, and a
    library's own write failure (torch's "basic_ios::clear", safetensors' I/O error) as the
    OSError it hides: ENOSPC when the filesystem is (nearly) full, EIO otherwise."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a failed write
        if not _hidden_write_failure(e):
            raise
        said = re.search(r"os error (\d+)", str(e))  # safetensors quotes the OS's error
        code = int(said.group(1)) if said else errno.ENOSPC \
            if shutil.disk_usage(nearest_existing(path)).free < (1 << 20) else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None


def _hidden_write_failure(e: Exception) -> bool:
    text = str(e)
    return (type(e).__name__ == "SafetensorError" and "I/O error" in text
            or isinstance(e, RuntimeError) and any(
                mark in text for mark in ("basic_ios", "inline_container", "PytorchStreamWriter",
                                          "file write failed")))


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (what a failed write's filesystem is)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_atomic(path: Path, data: str | bytes) -> None:
    """`path` holds `data`, or (after any failure) what it held before. The temporary file
    has a name of its own, so processes writing the same path at once never mix."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=f".{path.name}.tmp")
    try:
        with naming(path), os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def append_line(path: Path, line: str) -> None:
    """Appends `line` and a newline in one write, fsync'd; a write that fails is cut back off
    (a crash can still leave a cut last line: readers drop it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            with naming(path):
                os.write(fd, (line + "\n").encode())
                os.fsync(fd)
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def fresh_output(path: Path, overwrite: bool) -> None:
    """Refuses, before any work, an output path that holds something: writing it replaces
    the whole path (a directory with everything else in it)."""
    if overwrite or not path.exists() or path.is_dir() and not any(path.iterdir()):
        return
    from rlloom.config_errors import ConfigError
    held = (", ".join(sorted(p.name for p in path.iterdir())[:5]) if path.is_dir()
            else "a file")
    raise ConfigError(f"--out {path} already holds {held}; writing there would replace it: "
                      "choose another --out, or pass --overwrite to replace it")
