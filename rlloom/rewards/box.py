"""One isolated box per program, started by the judge (``rlloom.rewards.judge``).

The box is a fresh interpreter running ``box_server.py`` behind three pipes (requests,
replies, and what the program prints). How it is isolated depends on ``isolation``:

* ``strict`` and ``namespaces``: the judge forks a supervisor, which joins the program's
  cgroup (strict only: memory and process budget for the whole program, ``cgroups.py``),
  unshares mount, pid, network, IPC and UTS namespaces (plus a user namespace when not root)
  and forks the box's first process. That process is pid 1 of its own pid namespace (its own
  ``/proc``; when it dies the kernel kills everything the program started), builds a new root
  on a tmpfs (read-only binds of the interpreter, its libraries and the standard library
  only, ``box_files.py``; a private ``/tmp`` and ``/dev/shm``, four device nodes), pivots
  into it, sets rlimits, drops to a uid of its own (root hosts: ``next_uid``, unique among
  the host's last 2^31 boxes) with no_new_privs, installs the system-call filter
  (``seccomp.py``) and execs the interpreter, which clears the judge's memory. The network namespace has only a down loopback: no internet, no localhost, no
  abstract Unix sockets of the host, and no filesystem sockets are visible.
* ``process``: a plain child process with rlimits, a private working directory and (as root)
  a uid of its own; nothing else. For trusted programs only.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlloom.rewards import box_files, box_server, seccomp
from rlloom.rewards.box_files import Visible
from rlloom.rewards.cgroups import BoxCgroup

ISOLATIONS = ("strict", "namespaces", "process")
UID_BASE, UID_SPAN = 0x40000000, 0x80000000
_UID_COUNTER = os.path.join(tempfile.gettempdir(), "rlloom-box-uids")

_CLONE = {"mount": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "user": 0x10000000,
          "pid": 0x20000000, "net": 0x40000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_DEVICES = ("null", "zero", "random", "urandom")
_SERVER = Path(box_server.__file__).read_text(encoding="utf-8")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2              # CPU seconds per process of the program
    wall_s: float = 5.0         # wall-clock budget of the whole program (all its tests)
    memory_mb: int = 512        # per program (cgroup, strict) and per process (RLIMIT_AS)
    file_size_mb: int = 1       # largest file the program may write
    max_processes: int = 16     # per program (pids cgroup, and RLIMIT_NPROC of its own uid)
    max_open_files: int = 256   # per process (RLIMIT_NOFILE)
    max_output_bytes: int = 64_000  # what the program may print (the run stops past it)
    tmp_mb: int = 16            # its private /tmp and /dev/shm (tmpfs, counted as memory too)


class BoxDied(BaseException):
    """The box is gone (a limit, a crash, a timeout): no later call can be answered. A
    BaseException so that a test's ``except Exception`` cannot take it for the program's."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BoxConfig:
    """What every box of one judge shares, worked out once by ``BoxConfig.for_host``."""
    isolation: str
    interpreter: str
    visible: Visible | None             # the host files a box sees (None: process isolation)
    syscall_filter: bytes               # BPF refusing what boxes could share (seccomp.py)
    mount_point: str                    # an empty directory where the new root is built

    @classmethod
    def for_host(cls, isolation: str, visible: Visible | None = None) -> BoxConfig:
        """``visible``: what ``box_files.for_boxes`` found (by default, found here)."""
        if isolation not in ISOLATIONS:
            raise ValueError(f"unknown sandbox isolation {isolation!r}; use one of {ISOLATIONS}")
        interpreter = box_files.interpreter()
        if isolation == "process":
            if os.geteuid() == 0:
                interpreter = _readable_interpreter(interpreter)
            return cls(isolation, interpreter, None, b"", "")
        visible = visible or box_files.for_boxes()
        # one empty directory serves every box: each mounts its root there in a mount
        # namespace of its own, so the host never sees anything mounted on it
        mount_point = os.path.join(tempfile.gettempdir(), "rlloom-boxroot")
        os.makedirs(mount_point, mode=0o755, exist_ok=True)
        if os.path.islink(mount_point):
            raise OSError(f"{mount_point} is a symlink; remove it")
        return cls(isolation, interpreter, visible, seccomp.build(), mount_point)


def _readable_interpreter(preferred: str) -> str:
    """An interpreter the box's own uid can run without a new root of its own (process
    isolation): every directory on its path searchable by others, the file readable."""
    for candidate in (preferred, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = Path(os.path.realpath(candidate))
        if real.is_file() and real.stat().st_mode & 0o005 == 0o005 and \
                all(p.stat().st_mode & 0o001 for p in real.parents):
            return str(real)
    raise OSError("no Python interpreter that an unprivileged uid can run (the box's uid "
                  "cannot read one under /root); install python3 under /usr")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None,
           flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {target}")


def _bind_read_only(libc: ctypes.CDLL, source: str, target: str) -> None:
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)
    _mount(libc, None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _build_root(cfg: BoxConfig, limits: SandboxLimits) -> None:
    """In the box's mount namespace: a new root with only what the interpreter needs."""
    libc, root = _libc(), cfg.mount_point
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, "box", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    visible = cfg.visible
    for path, target in visible.links:
        os.symlink(target, root + path)
    for path in visible.dirs:
        os.makedirs(root + path, mode=0o755, exist_ok=True)
        _bind_read_only(libc, path, root + path)
    for path in visible.files:
        inside = root + box_files.in_box(path)
        os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
        if not os.path.exists(inside):
            Path(inside).touch()
            _bind_read_only(libc, path, inside)
    for path in visible.hidden:
        _mount(libc, "empty", root + path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
               "size=4k,mode=755")
    os.makedirs(root + "/dev", mode=0o755)
    _mount(libc, "dev", root + "/dev", "tmpfs", _MS_NOSUID, "size=64k,mode=755")
    for name in _DEVICES:
        Path(root, "dev", name).touch()
        _mount(libc, f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(root + path, mode=0o755, exist_ok=True)
        _mount(libc, "tmp", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV,
               f"size={limits.tmp_mb}m,mode=1777")
    os.makedirs(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.makedirs(root + "/.old")
    _check(libc.syscall(_SYS_PIVOT_ROOT[platform.machine()], root.encode(),
                        (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", _MNT_DETACH), "umount the old root")
    os.rmdir("/.old")
    _mount(libc, None, "/", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    _check(libc.sethostname(b"box", 3), "sethostname")


def _limit(limits: SandboxLimits) -> None:
    mb = 1 << 20
    for which, value in ((resource.RLIMIT_CPU, limits.cpu_s),
                         (resource.RLIMIT_AS, limits.memory_mb * mb),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb * mb),
                         (resource.RLIMIT_NPROC, limits.max_processes),
                         (resource.RLIMIT_NOFILE, limits.max_open_files),
                         (resource.RLIMIT_CORE, 0)):
        # soft == hard: pid 1 ignores SIGXCPU, so only the hard limit's SIGKILL would stop it
        resource.setrlimit(which, (value, value))


def next_uid() -> int:
    """A box uid that no box of this host had in the last ``UID_SPAN`` boxes (a counter in
    a file of this user's, locked while it moves on); pids would recur as they wrap."""
    fd = os.open(_UID_COUNTER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise OSError(f"{_UID_COUNTER} belongs to another user; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        head = os.pread(fd, 8, 0)
        count = (struct.unpack("!Q", head)[0] + 1) % UID_SPAN if len(head) == 8 else 0
        os.pwrite(fd, struct.pack("!Q", count), 0)
        return UID_BASE + count
    finally:
        os.close(fd)


def _become(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _exec_server(cfg: BoxConfig, limits: SandboxLimits, fds: dict[int, int], uid: int,
                 workdir: str) -> None:
    """The box's first process, after its namespaces: root, limits, uid, then the server."""
    libc = _libc()
    if cfg.isolation == "process":
        os.chdir(workdir)
    else:
        _build_root(cfg, limits)
        os.chdir("/tmp")
    _limit(limits)
    if uid >= 0:
        _become(uid)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # dies with its supervisor, which dies with the judge (set after the uid change clears it)
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if cfg.syscall_filter:
        seccomp.load(cfg.syscall_filter)
    # copies above every target first, so that no dup2 overwrites a source still to be moved
    high = {target: fcntl.fcntl(source, fcntl.F_DUPFD, max(fds) + 1)
            for target, source in fds.items()}
    for target, copy in high.items():
        os.dup2(copy, target)
    os.closerange(max(fds) + 1, 1 << 16)
    env = {"PATH": "/usr/bin:/bin", "HOME": os.getcwd(), "LANG": "C.UTF-8"}
    os.execve(cfg.interpreter, [cfg.interpreter, "-I", "-S", "-B", "-u", "-c", _SERVER], env)


def _supervise(cfg: BoxConfig, limits: SandboxLimits, fds: dict[int, int], status_w: int,
               setup_w: int, cgroup: BoxCgroup | None, workdir: str, box_uid: int) -> None:
    """The forked supervisor: cgroup, namespaces, then the box's first process; it reports
    that process's pid, waits for it, and reports how it ended and its CPU time."""
    libc = _libc()
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if cgroup is not None:
        cgroup.join(os.getpid())
    root = os.geteuid() == 0
    if cfg.isolation != "process":
        flags = sum(_CLONE[n] for n in ("mount", "uts", "ipc", "pid", "net"))
        uid, gid = os.getuid(), os.getgid()
        _check(libc.unshare(flags | (0 if root else _CLONE["user"])), "unshare")
        if not root:  # root of its own user namespace, mapped to the caller's uid
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
            Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_w)
            _exec_server(cfg, limits, fds, box_uid, workdir)
        except BaseException as e:  # noqa: BLE001 - reported to the judge, never raised
            os.write(setup_w, f"{type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(127)
    os.close(setup_w)
    for fd in set(fds.values()):
        os.close(fd)
    os.write(status_w, struct.pack("!i", pid))
    _, status, usage = os.wait4(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    os.write(status_w, struct.pack("!id", code, usage.ru_utime + usage.ru_stime))


class Box:
    """A box, started ahead of its program (the judge keeps one spare, so that the cgroup
    attach and the interpreter's start-up overlap the previous program's tests). ``begin``
    waits for it and starts its wall-clock budget; ``request`` sends one message to the
    server and returns its reply, raising ``BoxDied`` when the box is gone or its time or
    output budget is spent."""

    def __init__(self, cfg: BoxConfig, limits: SandboxLimits, name: str) -> None:
        self.limits, self.deadline = limits, float("inf")
        self.output, self.reason, self.pid = bytearray(), None, 0
        self._pending = bytearray()
        self.cgroup = BoxCgroup.create(name, limits.memory_mb << 20, limits.max_processes + 1) \
            if cfg.isolation == "strict" else None
        self.workdir = tempfile.mkdtemp(prefix="rlloom-box-") if cfg.isolation == "process" \
            else ""
        if self.workdir and os.geteuid() == 0:
            os.chmod(self.workdir, 0o777)
        box_uid = next_uid() if os.geteuid() == 0 else -1
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.out_r, out_w = os.pipe()
        status_r, status_w = os.pipe()
        setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
        null = os.open(os.devnull, os.O_RDONLY)
        fds = {0: null, 1: out_w, 2: out_w, box_server.IN_FD: req_r, box_server.OUT_FD: rep_w}
        self.supervisor = os.fork()
        if self.supervisor == 0:
            try:
                for fd in (self.req_w, self.rep_r, self.out_r, status_r, setup_r):
                    os.close(fd)
                _supervise(cfg, limits, fds, status_w, setup_w, self.cgroup, self.workdir,
                           box_uid)
            except BaseException as e:  # noqa: BLE001 - reported to the judge, never raised
                os.write(setup_w, f"{type(e).__name__}: {e}".encode()[:4000])
            finally:
                os._exit(0)
        for fd in (req_r, rep_w, out_w, status_w, setup_w, null):
            os.close(fd)
        self.status, self.setup = os.fdopen(status_r, "rb"), os.fdopen(setup_r, "rb")
        os.set_blocking(self.req_w, False)

    def _started(self) -> str:
        """Waits until the server was exec'd (or its setup failed: the failure's text)."""
        if self.setup.closed:
            return ""
        failure = self.setup.read().decode("utf-8", "replace")  # EOF at the exec
        self.setup.close()
        head = self.status.read(4)
        self.pid = struct.unpack("!i", head)[0] if len(head) == 4 else 0
        return failure

    def begin(self) -> None:
        """The program's turn: its wall-clock budget starts now."""
        failure = self._started()
        if failure:
            self.close()
            raise OSError(f"the sandbox could not start: {failure}")
        self.deadline = time.monotonic() + self.limits.wall_s

    def request(self, message: dict) -> dict:
        """Sends ``message`` and waits for the reply (draining the program's output)."""
        if self.reason:
            raise BoxDied(self.reason)
        payload = box_server.frame(message)
        with selectors.DefaultSelector() as sel:
            sel.register(self.rep_r, selectors.EVENT_READ)
            sel.register(self.out_r, selectors.EVENT_READ)
            if payload:
                sel.register(self.req_w, selectors.EVENT_WRITE)
            while True:
                reply = self._reply()
                if reply is not None:
                    return reply
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._die("timeout")
                for key, _ in sel.select(left):
                    if key.fd == self.req_w:
                        try:
                            payload = payload[os.write(self.req_w, payload[:65536]):]
                        except BrokenPipeError:
                            payload = b""
                        if not payload:
                            sel.unregister(self.req_w)
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        self._die(None)
                    if key.fd == self.rep_r:
                        self._pending += chunk
                    else:
                        self.output += chunk
                        if len(self.output) > self.limits.max_output_bytes:
                            self._die("output limit")

    def _reply(self) -> dict | None:
        if len(self._pending) < 4:
            return None
        (size,) = struct.unpack("!I", self._pending[:4])
        if size > box_server.MAX_MESSAGE:
            self._die("reply too large")
        if len(self._pending) < 4 + size:
            return None
        body, self._pending = bytes(self._pending[4:4 + size]), self._pending[4 + size:]
        if _lists(body) > _MAX_LISTS:
            # parsed, each costs the judge ~100 bytes: 16 MB of them would be 1.5 GB
            self._die("reply too large")
        try:
            reply = json.loads(body)
        except (ValueError, RecursionError):
            self._die("malformed reply")
        if not isinstance(reply, dict):
            self._die("malformed reply")
        return reply

    def _die(self, reason: str | None) -> None:
        ended = self.close()
        # a program whose processes the kernel killed for memory ran out of memory, whatever
        # then ended the box (its time, typically, waiting for them)
        self.reason = self.reason or (ended if ended == "memory limit" else reason or ended)
        raise BoxDied(self.reason)

    def kill(self) -> None:
        """Ends the box at once, keeping what it printed; ``close`` then cleans up."""
        self._started()
        if self.pid:
            os.set_blocking(self.out_r, False)
            room = self.limits.max_output_bytes - len(self.output)
            try:
                while room > 0 and (chunk := os.read(self.out_r, min(room, 65536))):
                    self.output += chunk
                    room -= len(chunk)
            except BlockingIOError:
                pass
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = 0

    def close(self) -> str:
        """Kills the box if it still runs, cleans up, and says how it ended."""
        if self.supervisor == 0:
            return self.reason or "closed"
        self.kill()
        tail = self.status.read(12)
        self.status.close()
        os.waitpid(self.supervisor, 0)
        self.supervisor = 0
        code, cpu = struct.unpack("!id", tail) if len(tail) == 12 else (0, 0.0)
        for fd in (self.req_w, self.rep_r, self.out_r):
            os.close(fd)
        oom = self.cgroup.oom_killed() if self.cgroup else False
        if self.cgroup:
            self.cgroup.remove()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return _describe(code, cpu, oom, self.limits)


_MAX_LISTS = 2 * box_server.MAX_ITEMS + 16  # a tagged value is a list, a container two
_STRINGS = re.compile(rb'"(?:[^"\\]+|\\.)*"')


def _lists(body: bytes) -> int:
    """How many JSON arrays ``body`` holds (brackets inside strings do not count)."""
    count = body.count(b"[")
    if count <= _MAX_LISTS:
        return count
    # one string at a time: substituting them all away would build a list of every piece
    return count - sum(m.group().count(b"[") for m in _STRINGS.finditer(body))


CPU_LIMIT_SHARE = 0.8  # of `SandboxLimits.cpu_s`: a kill past it is the CPU limit's


def _describe(code: int, cpu: float, oom: bool, limits: SandboxLimits) -> str:
    if oom:
        return "memory limit"
    # The kernel enforces RLIMIT_CPU on tick-sampled CPU time, which overcharges a process
    # that shares its core with others: a busy loop under a 1 s limit was killed after
    # 0.904 s of the exact time wait4 reports, while another test suite ran beside it.
    if code in (-signal.SIGKILL, -signal.SIGXCPU) and cpu >= CPU_LIMIT_SHARE * limits.cpu_s:
        return "cpu limit"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit code {code}" if code else "exited"

