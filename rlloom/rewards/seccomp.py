"""The box's system-call filter: the kernel objects that no namespace here separates.

Namespaces give a box its own files, pids, network and IPC, but some kernel state is shared
by every process of the host, and two programs scored one after the other (or side by side,
as the K samples of a prompt are) could pass an answer through it:

* kernel keyrings (a key added by one box is readable by a later one: ``add_key``,
  ``keyctl``, ``request_key``);
* locks and change notifications on files both boxes see (``flock``, ``fcntl`` locks and
  leases, ``inotify``, ``fanotify``);
* the page cache of those files: probes of what is cached (``mincore``, ``cachestat``,
  ``preadv2``'s no-wait reads) and eviction (``fadvise64``, ``madvise`` cold/pageout,
  ``process_madvise``, ``readahead``). The judge also reads every file a box can see before
  its first box starts (``BoxConfig.for_host``), so reading one changes nothing another can
  time.

The filter also refuses what a scored program never needs and what widens the kernel's attack
surface: new namespaces (``unshare``, ``setns``, ``clone`` with namespace flags; ``clone3``
answers ENOSYS, so libc falls back to ``clone``, whose flags a filter can read), mounts,
``ptrace`` and cross-process memory, ``io_uring`` (its operations bypass this filter),
``bpf``, ``perf_event_open``, ``userfaultfd``, modules, kexec, swap, reboot, syslog.
Everything else is allowed: scored programs are ordinary Python.

The filter is built once per judge with libseccomp (the system's ``libseccomp.so.2``, through
ctypes: it knows each architecture's call numbers and makes calls of another ABI, such as
32-bit ones on x86-64, kill the process) and exported as BPF, which each box loads with one
``prctl`` before it execs its interpreter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_REFUSED = (
    "add_key", "keyctl", "request_key",
    "flock", "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init",
    "fanotify_mark",
    "mincore", "cachestat", "preadv2", "pwritev2", "fadvise64", "readahead", "process_madvise",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr", "open_by_handle_at",
    "name_to_handle_at",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl",
    "quotactl_fd")
# calls newer than some libseccomp releases: numbered alike on every architecture since 424
_UNIFIED_NUMBERS = {"cachestat": 451, "quotactl_fd": 443, "mount_setattr": 442,
                    "process_madvise": 440, "pidfd_getfd": 438}
_NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                    0x20000000, 0x40000000)  # time, mount, cgroup, uts, ipc, user, pid, net
_LOCK_COMMANDS = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)  # F_{GET,SET}LK(W), OFD, lease, notify
_EVICTING_ADVICE = (20, 21)  # MADV_COLD, MADV_PAGEOUT
_ALLOW = 0x7FFF0000
_CMP_EQ, _CMP_MASKED_EQ = 4, 7
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _errno_action(code: int) -> int:
    return 0x00050000 | code


def build() -> bytes:
    """The filter as BPF instructions, ready for ``load``. OSError when this host has no
    libseccomp (install the ``libseccomp2`` package) or it refuses a rule."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise OSError("libseccomp is not installed (apt install libseccomp2, dnf install "
                      "libseccomp); the box's system-call filter needs it") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ALLOW)
    if not ctx:
        raise OSError("libseccomp could not start a filter")

    def rule(call: str, action: int, *cmps: tuple[int, int, int, int]) -> None:
        nr = lib.seccomp_syscall_resolve_name(call.encode())
        if nr == -1:  # unknown to this libseccomp (or this architecture)
            nr = _UNIFIED_NUMBERS.get(call, -1)
            if nr == -1:
                return
        array = (_ArgCmp * max(len(cmps), 1))(*(_ArgCmp(*c) for c in cmps))
        result = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
        if result < 0:
            raise OSError(-result, f"libseccomp refused the rule for {call}")

    try:
        for call in _REFUSED:
            rule(call, _errno_action(errno.EPERM))
        rule("clone3", _errno_action(errno.ENOSYS))
        for flag in _NAMESPACE_FLAGS:
            rule("clone", _errno_action(errno.EPERM), (0, _CMP_MASKED_EQ, flag, flag))
        for command in _LOCK_COMMANDS:
            rule("fcntl", _errno_action(errno.EPERM), (1, _CMP_EQ, command, 0))
        for advice in _EVICTING_ADVICE:
            rule("madvise", _errno_action(errno.EPERM), (2, _CMP_EQ, advice, 0))
        read, write = os.pipe()
        try:
            result = lib.seccomp_export_bpf(ctx, write)
            os.close(write)
            write = -1
            if result < 0:
                raise OSError(-result, "libseccomp could not export the filter")
            chunks = []
            while chunk := os.read(read, 65536):
                chunks.append(chunk)
        finally:
            os.close(read)
            if write >= 0:
                os.close(write)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)


def load(program: bytes) -> None:
    """Installs ``program`` (from ``build``) on this process and every process it starts;
    needs no_new_privs (or CAP_SYS_ADMIN) first. Python and ctypes only: nothing to load
    in the box."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"installing the system-call filter: {os.strerror(err)}")
