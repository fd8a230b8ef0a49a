"""Channels between two programs through kernel state that no namespace separates: a planter
(the correct program) leaves a bit in the channel, a thief (a wrong program) looks for it and
turns right when it finds it. Each pair first runs as two plain processes on this host, where
the thief does find the bit (so the channel is real), then through the sandbox, one after the
other and side by side: the thief scores 0, and the same pool then scores the correct program
1 and a wrong one 0. docs/sandbox.md lists the calls the box's filter refuses."""
import ctypes
import mmap
import os
import platform
import subprocess
import sys
import uuid

import pytest

from rlloom.rewards import box_files

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="the channels call the kernel by x86-64 numbers")

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
CORRECT, WRONG = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"
_TAG = f"rlloom-{uuid.uuid4().hex[:12]}"
_PRELUDE = f"""\
import ctypes, fcntl, os, struct, time
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL, MINCORE, INOTIFY_INIT1, INOTIFY_ADD_WATCH = 248, 250, 27, 294, 254
SHARED = __import__('string').__file__  # a file every box (and this host) sees
TAG = {_TAG!r}.encode()

def _ok(result, what):
    if result < 0:
        raise OSError(ctypes.get_errno(), what)
    return result

def _poll(found, seconds=1.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found():
            return True
        time.sleep(0.02)
    return False

def _key():  # searched in this uid's keyring and in the session's
    return any(libc.syscall(KEYCTL, 10, ctypes.c_long(ring), b'user', TAG, 0) > 0
               for ring in (-4, -3))

def _evicted():
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open(SHARED, 'rb') as f:
        addr = libc.mmap(None, 4096, 1, 1, f.fileno(), 0)
    try:  # unmapped after: a page still mapped cannot be evicted
        vec = ctypes.create_string_buffer(1)
        _ok(libc.syscall(MINCORE, ctypes.c_void_p(addr), ctypes.c_size_t(4096), vec), 'mincore')
        return vec.raw[0] & 1 == 0
    finally:
        libc.munmap(addr, 4096)

def _flocked():
    with open(SHARED) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True

def _posix_locked():
    with open(SHARED) as f:
        query = struct.pack('hhqqixxxx', fcntl.F_WRLCK, 0, 0, 0, 0)
        return struct.unpack('hhqqixxxx', fcntl.fcntl(f, fcntl.F_GETLK, query))[0] != fcntl.F_UNLCK

_watch = None
def _accessed():
    global _watch
    if _watch is None:
        _watch = _ok(libc.syscall(INOTIFY_INIT1, os.O_NONBLOCK), 'inotify')
        _ok(libc.syscall(INOTIFY_ADD_WATCH, _watch, SHARED.encode(), 1), 'watch')  # IN_ACCESS
    try:
        return bool(os.read(_watch, 4096))
    except BlockingIOError:
        return False
"""

# name -> (what the planter does, the thief's test for the bit)
CHANNELS = {
    # a key in the uid's keyring (a box's uid recurs) or in a session keyring both inherit
    "keyring": ("_ok(libc.syscall(ADD_KEY, b'user', TAG, b'1', 1, ctypes.c_long(-4)), 'key')",
                "_key"),
    # evicted by one, seen gone by the other (the kernel already limits both calls to files
    # the caller owns or may write, which a box's uid never does; the filter refuses them
    # whatever the uid, and the warmed page cache leaves a read nothing to change)
    "page_cache": ("os.posix_fadvise(os.open(SHARED, os.O_RDONLY), 0, 0, "
                   "os.POSIX_FADV_DONTNEED)", "_evicted"),
    "flock": ("held = open(SHARED)\nfcntl.flock(held, fcntl.LOCK_SH)\ntime.sleep(0.8)",
              "_flocked"),
    "posix_lock": ("held = open(SHARED)\nfcntl.lockf(held, fcntl.LOCK_SH)\ntime.sleep(0.8)",
                   "_posix_locked"),
    "inotify": ("time.sleep(0.3)\nopen(SHARED).read()", "_accessed"),
}
SEQUENTIAL = ("keyring", "page_cache")  # the others need the planter alive


def planter(name: str) -> str:
    body = "".join(f"    {line}\n" for line in CHANNELS[name][0].splitlines())
    return f"{_PRELUDE}try:\n{body}except OSError:\n    pass\n{CORRECT}"


def thief(name: str) -> str:
    return (f"{_PRELUDE}try:\n    FOUND = _poll({CHANNELS[name][1]})\nexcept OSError:\n"
            f"    FOUND = False\ndef add(a, b):\n    return a + b if FOUND else a - b\n")


@pytest.mark.parametrize("name", sorted(CHANNELS))
def test_the_channel_is_real_between_two_plain_processes(name):
    run = [sys.executable, "-I", "-c"]
    thief_proc = subprocess.Popen([*run, thief(name) + "print(FOUND)"], stdout=subprocess.PIPE,
                                  text=True)
    subprocess.run([*run, planter(name)], check=True)
    assert thief_proc.communicate(timeout=30)[0].strip() == "True"
    if name == "keyring":  # drops the key from this session's keyring
        subprocess.run([*run, _PRELUDE + "libc.syscall(KEYCTL, 21, libc.syscall(KEYCTL, 10, "
                        "ctypes.c_long(-4), b'user', TAG, 0))"], check=True)


@pytest.mark.parametrize("name, together", [(n, True) for n in sorted(CHANNELS)] +
                         [(n, False) for n in SEQUENTIAL])
def test_no_channel_between_boxes(pool, name, together):
    pair = [(planter(name), TESTS), (thief(name), TESTS)]
    results = pool.map(pair) if together else pool.map(pair[:1]) + pool.map(pair[1:])
    assert [r.fraction for r in results] == [1.0, 0.0], results
    assert [r.fraction for r in pool.map([(CORRECT, TESTS), (WRONG, TESTS)])] == [1.0, 0.0]


def _resident(path: str) -> bool:
    """Whether every page of ``path`` is in the page cache (mincore of a mapping of it)."""
    size = os.path.getsize(path)
    if not size:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    try:
        vec = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return all(b & 1 for b in vec.raw[:pages])
    finally:
        libc.munmap(addr, size)


def test_every_file_a_box_sees_is_in_the_page_cache():
    visible = box_files.for_boxes()
    assert box_files.warm(visible) > 10 << 20
    paths = list(visible.files) + [
        os.path.join(where, n) for top in visible.dirs for where, _, names in os.walk(top)
        if not any(where == h or where.startswith(h + "/") for h in visible.hidden)
        for n in names]
    assert len(paths) > 500
    # a busy host can evict a page between the read and the check: read those again
    absent = [p for p in paths if not _resident(p)]
    box_files.warm(box_files.Visible((), tuple(absent), (), ()))
    assert [p for p in absent if not _resident(p)] == []
