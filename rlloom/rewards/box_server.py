"""The program's side of the sandbox: runs inside the box as ``python -I -S -B -c SOURCE``.

Stdlib only, and self-contained: the box sees no rlloom files, so the judge sends this file's
source on the command line. It holds nothing the program must not see (the tests and expected
values stay in the judge, ``rlloom.rewards.judge``) and nothing here is trusted: the program
runs in this very process and may rewrite any of it. Whatever this process answers, the judge
decodes strictly (``decode``) as plain builtin data, so a program that tampers with it can only
answer values, which is what solving the task means.

Requests and replies are length-prefixed JSON on fds 3 (requests) and 4 (replies):
  load {code}                 -> {names: {name: "function" | "class" | tagged value}} or {fail}
  call {target, args, kwargs} -> {value, args (when the call returned None)} or {raised}
  main {code, stdin, timeout_s, max_output} -> {stdout, stderr, exit, signal, timeout, overflow}
"""

from __future__ import annotations

import builtins
import json
import os
import select
import shutil
import signal
import struct
import sys
import time

IN_FD, OUT_FD = 3, 4
MAX_ITEMS = 100_000  # elements of one encoded value
MAX_DEPTH = 100  # nesting of one encoded value
MAX_SHARED_HASHES = 64  # members of one set (or keys of one dict) whose hash another has
MAX_MESSAGE = 16 << 20
_KINDS = {type(None): "n", bool: "b", int: "i", float: "f", str: "s", bytes: "y", list: "l",
          tuple: "t", dict: "d", set: "S", frozenset: "F"}


class NotPlain(TypeError):
    """A value that is not plain builtin data (or is too large to send)."""


def encode(value: object, refs: dict | None = None, budget: list | None = None) -> list:
    """``value`` as tagged plain data, checked by exact builtin type: ["i", "1f"], ["s", "x"],
    ["l", [...]], ["d", [k, v, k, v, ...]]. ``refs`` maps id() of other objects that may be
    sent by reference to their tag (the judge's proxies for the program's functions)."""
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise NotPlain("value too large")
    if refs and id(value) in refs:
        return refs[id(value)]
    kind = _KINDS.get(type(value))
    if kind is None:
        raise NotPlain(f"not plain data: {type(value).__name__}")
    if kind == "n":
        return ["n"]
    if kind == "i":
        return ["i", int.__format__(value, "x")]  # hex: no 4300-digit str() limit
    if kind == "f":
        return ["f", float.__repr__(value)]
    if kind == "y":
        return ["y", bytes.hex(value)]
    if kind in "bs":
        return [kind, value]
    if kind == "d":
        return ["d", [item for k, v in dict.items(value)
                      for item in (encode(k, refs, budget), encode(v, refs, budget))]]
    return [kind, [encode(v, refs, budget) for v in value]]


def decode(tagged: object, refs=None, budget: list | None = None, depth: int = 0) -> object:
    """Tagged plain data back to exact builtin values; ValueError on anything malformed.
    ``refs(tag)`` resolves reference tags ("r", "h"); without it they are malformed. Bounded
    and linear in the value: at most MAX_ITEMS elements, MAX_DEPTH levels, and sets and dict
    keys whose members share a hash (which makes building them quadratic) are refused."""
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or depth > MAX_DEPTH:
        raise ValueError("value too large")
    if not isinstance(tagged, list) or not tagged or not isinstance(tagged[0], str):
        raise ValueError("malformed value")
    kind, body = tagged[0], tagged[1:]
    if kind == "n" and not body:
        return None
    if len(body) != 1:
        raise ValueError("malformed value")
    item = body[0]
    if kind in ("r", "h") and refs is not None:
        return refs(tagged)
    if kind == "b" and type(item) is bool or kind == "s" and type(item) is str:
        return item
    if type(item) is str and kind in ("i", "f", "y"):
        return {"i": lambda s: int(s, 16), "f": float, "y": bytes.fromhex}[kind](item)
    if type(item) is not list or kind not in ("l", "t", "d", "S", "F"):
        raise ValueError("malformed value")
    items = [decode(v, refs, budget, depth + 1) for v in item]
    if kind == "d" and len(items) % 2:
        raise ValueError("malformed value")
    if kind in "dSF":
        _distinct_hashes(items[0::2] if kind == "d" else items)
    return {"l": list, "t": tuple, "d": lambda i: dict(zip(i[0::2], i[1::2])), "S": set,
            "F": frozenset}[kind](items)


def _distinct_hashes(members: list) -> None:
    # Hashes of ints, floats, tuples and frozensets are not randomised, so a reply can hold
    # many members with one hash; a set of hash values is collision-free (a hash is its own
    # hash), so counting them is linear.
    try:
        hashes = [hash(m) for m in members]
    except TypeError:  # an unhashable key or member
        raise ValueError("malformed value") from None
    if len(hashes) - len(set(hashes)) > MAX_SHARED_HASHES:
        raise ValueError("members that share a hash")


def read_message(fd: int) -> object:
    """One length-prefixed JSON message; EOFError when the other side is gone."""
    head = _read_exact(fd, 4)
    (size,) = struct.unpack("!I", head)
    if size > MAX_MESSAGE:
        raise ValueError("message too large")
    return json.loads(_read_exact(fd, size))


def _read_exact(fd: int, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = os.read(fd, n - len(got))
        if not chunk:
            raise EOFError
        got += chunk
    return bytes(got)


def frame(message: object) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("!I", len(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data[:65536]):]


def _raised(e: BaseException) -> list:
    """[type name, nearest builtin base's name, message]: the judge re-raises it as a class of
    that name deriving from that base, so `except ValueError` works on the judge's side."""
    base = next((c.__name__ for c in type(e).__mro__ if getattr(builtins, c.__name__, None) is c),
                "BaseException")
    try:
        message = str(e)[:2000]
    except BaseException:  # noqa: BLE001 - the program's __str__ may raise
        message = ""
    return [type(e).__name__, base, message]


class Server:
    def __init__(self) -> None:
        self.ns: dict = {"__name__": "solution", "__builtins__": builtins}
        self.classes: set = set()
        self.handles: dict[int, object] = {}

    def load(self, request: dict) -> dict:
        try:
            code = compile(request["code"], "solution.py", "exec")
        except (SyntaxError, ValueError):
            return {"fail": "syntax error"}
        try:
            exec(code, self.ns)
        except MemoryError:
            return {"fail": "memory limit"}
        except SystemExit:
            return {"fail": "exit"}
        except BaseException as e:  # noqa: BLE001 - any crash of the program scores 0
            os.write(2, f"{type(e).__name__}: {e}\n".encode("utf-8", "replace"))
            return {"fail": f"error: {type(e).__name__}"}
        names = {}
        for name, value in list(self.ns.items()):
            if name.startswith("__"):
                continue
            if isinstance(value, type):
                self.classes.add(value)
                names[name] = "class"
            elif callable(value):
                names[name] = "function"
            else:
                try:
                    names[name] = encode(value)
                except (NotPlain, RecursionError):
                    pass
        return {"names": names}

    def _resolve(self, tag: list) -> object:
        if tag[0] == "r":
            return self.ns[tag[1]]
        return self.handles[int(tag[1])]

    def call(self, request: dict) -> dict:
        try:
            kind, *where = request["target"]
            fn = self.ns[where[0]] if kind == "f" else getattr(self.handles[where[0]], where[1])
            args = [decode(a, self._resolve) for a in request["args"]]
            kwargs = {k: decode(v, self._resolve) for k, v in request["kwargs"].items()}
            value = fn(*args, **kwargs)
            if type(value) in self.classes:
                self.handles[len(self.handles)] = value
                return {"value": ["h", len(self.handles) - 1]}
            reply = {"value": encode(value)}
            if value is None:  # an in-place function: the judge copies the arguments back
                reply["args"] = [encode(a) for a in args]
            return reply
        except BaseException as e:  # noqa: BLE001 - reported to the judge as data
            return {"raised": _raised(e)}

    def main(self, request: dict) -> dict:
        """Runs the program as __main__ in a fresh forked process with ``stdin``; what it wrote."""
        _empty_scratch()
        pipes = [os.pipe() for _ in range(3)]
        pid = os.fork()
        if pid == 0:
            _run_main(request["code"], pipes)
        for r, w in pipes:
            os.close(r if (r, w) == pipes[0] else w)
        return _relay(pid, pipes[0][1], pipes[1][0], pipes[2][0], request)


def _empty_scratch() -> None:
    """Each run starts with an empty /tmp, when /tmp is the box's own (namespaces)."""
    if os.getcwd() != "/tmp":
        return
    for entry in os.scandir("/tmp"):
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _run_main(code: str, pipes: list) -> None:
    status = 1
    try:
        os.setpgid(0, 0)
        for target, (r, w) in enumerate(pipes):
            os.dup2(r if target == 0 else w, target)
        os.closerange(3, 1 << 16)
        try:
            exec(compile(code, "solution.py", "exec"), {"__name__": "__main__",
                                                         "__builtins__": builtins})
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # noqa: BLE001 - reported as the exit status
            os.write(2, f"{type(e).__name__}: {e}\n".encode("utf-8", "replace"))
        for stream in ("stdout", "stderr"):
            getattr(sys, stream).flush()
    finally:
        os._exit(status & 0xFF)


def _relay(pid: int, stdin_fd: int, out_fd: int, err_fd: int, request: dict) -> dict:
    """Feeds stdin and collects stdout/stderr up to ``max_output`` bytes until the process
    exits or ``timeout_s`` passes (then the process group is killed)."""
    deadline = time.monotonic() + request["timeout_s"]
    data, cap = request["stdin"].encode(), request["max_output"]
    out, err = bytearray(), bytearray()
    reply = {"timeout": False, "overflow": False, "exit": None, "signal": None}
    readers, writers = [out_fd, err_fd], [stdin_fd] if data else []
    if not data:
        os.close(stdin_fd)
    status = None
    while readers or status is None:
        if status is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            status = status if done else None
        left = deadline - time.monotonic()
        if left <= 0 or status is not None and not readers:
            break
        ready_r, ready_w, _ = select.select(readers, writers, [], min(left, 0.05))
        for fd in ready_w:
            try:
                data = data[os.write(fd, data[:65536]):]
            except BrokenPipeError:
                data = b""
            if not data:
                writers.remove(fd)
                os.close(fd)
        for fd in ready_r:
            chunk = os.read(fd, 65536)
            if not chunk:
                readers.remove(fd)
                continue
            (out if fd == out_fd else err).extend(chunk)
            if len(out) + len(err) > cap:
                reply["overflow"] = True
                readers = []
        if reply["overflow"]:
            break
        if status is not None and readers and not ready_r:
            break  # exited; a leftover child holds the pipes open
    if status is None:
        reply["timeout"] = not reply["overflow"]
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    for fd in [out_fd, err_fd, *writers]:
        os.close(fd)
    if os.WIFSIGNALED(status):
        reply["signal"] = os.WTERMSIG(status)
    else:
        reply["exit"] = os.WEXITSTATUS(status)
    reply["stdout"] = bytes(out[:cap]).decode("utf-8", "replace")
    reply["stderr"] = bytes(err[:max(cap - len(out), 0)]).decode("utf-8", "replace")
    return reply


def serve() -> None:
    server = Server()
    handlers = {"load": server.load, "call": server.call, "main": server.main}
    while True:
        try:
            request = read_message(IN_FD)
        except EOFError:
            os._exit(0)
        reply = handlers[request["op"]](request)
        try:
            payload = frame(reply)
        except (TypeError, ValueError, RecursionError):
            payload = frame({"raised": ["TypeError", "TypeError", "reply not encodable"]})
        _write_all(OUT_FD, payload)


if __name__ == "__main__":
    serve()
