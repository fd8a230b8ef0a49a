"""What a box can see of the host's files: the interpreter, the shared libraries it and the
standard library's extension modules load, and the standard library itself (its
site-packages and tests masked). Nothing else of ``/usr``: no shell, no other program, no
data, so a box has no file in common with another box beyond these, all read-only.

Every one of these files is read once by the judge before its first box starts (``warm``),
so their pages are in the page cache: a program that reads one changes nothing that a later
program could time, and the system-call filter (``seccomp.py``) refuses eviction and the
probes of what is cached.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# never needed by a scored program: installed packages, the test suite, the GUI and its
# demos, the installer, the build configuration (a static libpython of tens of MB)
_MASKED = ("site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo",
           "ensurepip", "lib2to3", "config-*")
_UNUSED_MODULES = ("_tkinter", "readline", "_curses", "_curses_panel")  # with their libraries


@dataclass(frozen=True)
class Visible:
    dirs: tuple[str, ...]               # host directories bound read-only at the same path
    files: tuple[str, ...]              # host files bound read-only at the same path
    links: tuple[tuple[str, str], ...]  # (path, target): /lib -> usr/lib and the like
    hidden: tuple[str, ...]             # masked by an empty read-only tmpfs

    def to_json(self) -> str:
        return json.dumps([self.dirs, self.files, self.links, self.hidden])

    @classmethod
    def from_json(cls, text: str) -> Visible:
        dirs, files, links, hidden = json.loads(text)
        return cls(tuple(dirs), tuple(files), tuple(tuple(link) for link in links), tuple(hidden))


def interpreter() -> str:
    """The interpreter boxes run: the real file behind this one (a virtual environment's
    python is a link to it; the environment's packages stay outside the box)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


@functools.cache
def for_boxes() -> Visible:
    """This host's ``find``, warmed: worked out once per process (``ldd`` takes most of a
    second) and handed to every judge it starts."""
    visible = find(interpreter())
    warm(visible)
    return visible


def _libraries(binaries: list[str]) -> list[str]:
    """The shared libraries (and the loader) that ``binaries`` load, as paths the loader
    opens: ``ldd`` reads them from the binaries' own headers and the host's search path."""
    try:
        out = subprocess.run(["ldd", *binaries], capture_output=True, text=True,
                             check=False, timeout=60).stdout
    except FileNotFoundError:
        raise OSError("ldd is not installed (it comes with the C library's tools, e.g. "
                      "Debian's libc-bin); the sandbox needs it to find what the interpreter "
                      "loads") from None
    found = []
    for line in out.splitlines():
        if line.endswith(":"):  # the name of the binary whose libraries follow
            continue
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0] if words else ""
        if path.startswith("/") and path not in found:
            found.append(path)
    return found


def find(interpreter: str) -> Visible:
    """The files a box of ``interpreter`` sees (``interpreter`` is a real path)."""
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = Path(prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    modules = sorted(str(p) for p in (stdlib / "lib-dynload").glob("*.so")
                     if p.name.split(".")[0] not in _UNUSED_MODULES)
    files = [interpreter, *_libraries([interpreter, *modules])]
    links = tuple((top, os.readlink(top)) for top in ("/bin", "/sbin", "/lib", "/lib64",
                                                      "/lib32") if os.path.islink(top))
    hidden = tuple(str(p) for name in _MASKED for p in sorted(stdlib.glob(name)) if p.is_dir())
    return Visible((str(stdlib),), tuple(files), links, hidden)


def in_box(path: str) -> str:
    """Where ``path`` is bound in the box's root: its directory's real path (so that a bind
    never goes through a symlink, which would resolve on the host) and its own name (the
    name the loader asks for, ``libz.so.1``, even where that is a symlink on the host)."""
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def warm(visible: Visible) -> int:
    """Reads every file a box can see, so all of them are in the page cache; the bytes read."""
    total, buffer = 0, bytearray(1 << 20)
    paths = list(visible.files)
    for top in visible.dirs:
        for where, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if os.path.join(where, d) not in visible.hidden]
            paths += [os.path.join(where, n) for n in names]
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    total += n
        except OSError:
            pass  # unreadable here means unreadable in the box too
    return total
