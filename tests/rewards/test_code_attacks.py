"""Programs an RL policy could learn to write to pass code tests without solving the task,
tried on several test shapes (literal and computed expectations, tolerances, `in`, loops over
cases, helpers, expected exceptions, in-place mutation). Each attack is wrong for its task
and scores 0; right after it, through the same pool, the task's correct program scores 1
and a wrong one 0. Attacks are grouped by the class of hole they probe (docs/sandbox.md)."""
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from rlloom.rewards.sandbox import RunResult


@dataclass(frozen=True)
class Task:
    tests: list[str]
    correct: str
    wrong: str


TASKS = {
    "add": Task(["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
                "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"),
    "reverse": Task(["assert reverse('abc') == 'cba'",
                     "s = 'hello'\nassert reverse(s) == s[::-1]"],
                    "def reverse(s):\n    return s[::-1]\n", "def reverse(s):\n    return s\n"),
    "is_prime": Task(["for n, want in [(2, True), (9, False), (13, True), (1, False)]:\n"
                      "    assert is_prime(n) == want",
                      "assert is_prime(97)",
                      "assert [n for n in range(20) if is_prime(n)] == "
                      "[2, 3, 5, 7, 11, 13, 17, 19]"],
                     "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n",
                     "def is_prime(n):\n    return n in (1, 9)\n"),
    "sqrt": Task(["assert abs(sqrt(2.0) - 1.41421356) < 1e-6",
                  "import math\nassert math.isclose(sqrt(9.0), 3.0)",
                  "assert round(sqrt(0.25), 6) == 0.5"],
                 "def sqrt(x):\n    return x ** 0.5\n", "def sqrt(x):\n    return x / 2\n"),
    "sort": Task(["want = [1, 2, 3]\nassert sort_list([3, 1, 2]) == want",
                  "xs = [5, 3, 4]\nassert sort_list(xs) == sorted(xs)",
                  "data = [9, 7]\nexpected = sorted(data)\nassert sort_list(data) == expected"],
                 "def sort_list(xs):\n    return sorted(xs)\n",
                 "def sort_list(xs):\n    return list(xs)\n"),
    "mode": Task(["assert mode([1, 2, 2, 3]) in [2]", "assert mode([4, 4, 1]) in (4,)",
                  "assert mode([7]) in {7}"],
                 "from collections import Counter\n"
                 "def mode(xs):\n    return Counter(xs).most_common(1)[0][0]\n",
                 "def mode(xs):\n    return min(xs) - 1\n"),
    "safe_div": Task(["try:\n    safe_div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n"
                      "    raise AssertionError('no error')",
                      "assert safe_div(6, 3) == 2"],
                     "def safe_div(a, b):\n    if b == 0:\n"
                     "        raise ZeroDivisionError('b is 0')\n    return a / b\n",
                     "def safe_div(a, b):\n    return a * b if b else None\n"),
    "sort_in_place": Task(["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
                           "ys = [2, 3, 1]\nassert sort_in_place(ys) is None and ys == [1, 2, 3]"],
                          "def sort_in_place(xs):\n    xs.sort()\n",
                          "def sort_in_place(xs):\n    xs.reverse()\n"),
    "square": Task(["def check(candidate):\n    assert candidate(4) == 16\n"
                    "    assert candidate(-3) == 9\ncheck(square)"],
                   "def square(x):\n    return x * x\n", "def square(x):\n    return x + x\n"),
}

HERE = os.path.abspath(__file__)
# where the answer server's address is, and its abstract socket: per process, since test
# workers each serve their own (one name made the second worker's setup fail, "Address
# already in use", and one file its teardown, removed by the other)
ANSWER_PORT_FILE = f"/tmp/rlloom-attack-answer-server-{os.getpid()}"
ABSTRACT_NAME = f"rlloom-attack-answers-{os.getpid()}"

# An answer server stands in for anything on the host a program should not reach: it hands
# the add task's answers to whoever connects (TCP on localhost, a Unix socket file, an
# abstract Unix socket).
ASK = """
def ask(connect):
    import json
    try:
        return json.loads(connect())
    except Exception:
        return {}
"""

ATTACKS = {
    # -- comparisons that are not strict: objects that compare equal, patched helpers --
    "member_always_equal": ("mode", """
class Any:
    def __eq__(self, other): return True
    def __hash__(self): return 7
def mode(xs): return Any()
"""),
    "member_generator": ("mode", "def mode(xs):\n    return (x for x in [2, 4, 7])\n"),
    "tolerance_patch_abs": ("sqrt", """
import builtins
builtins.abs = lambda x: 0.0
builtins.round = lambda x, n=0: 0.5
def sqrt(x): return x / 2
"""),
    "tolerance_patch_isclose": ("sqrt", """
import math
math.isclose = lambda *a, **k: True
def sqrt(x): return x / 2
"""),
    "tolerance_sys_modules": ("sqrt", """
import sys, types
fake = types.ModuleType("math")
fake.isclose = lambda *a, **k: True
sys.modules["math"] = fake
def sqrt(x): return x / 2
"""),
    "overloaded_arithmetic": ("sqrt", """
class Zero:
    def __sub__(self, other): return 0.0
    def __rsub__(self, other): return 0.0
    def __abs__(self): return 0.0
    def __round__(self, n=0): return 0.5
    def __float__(self): return 3.0
    def __eq__(self, other): return True
def sqrt(x): return Zero()
"""),
    "float_subclass": ("sqrt", """
class F(float):
    def __sub__(self, other): return F(0.0)
    def __rsub__(self, other): return F(0.0)
    def __eq__(self, other): return True
    __hash__ = float.__hash__
def sqrt(x): return F(x / 2)
"""),
    "nan_result": ("sqrt", "def sqrt(x):\n    return float('nan')\n"),
    "mutate_test_input": ("sort", """
def sort_list(xs):
    xs.clear()
    return []
"""),
    "shadow_builtin_sorted": ("sort", """
def sorted(xs): return list(xs)
def sort_list(xs): return list(xs)
"""),
    "shadow_builtin_abs_and_round": ("sqrt", """
def abs(x): return 0.0
def round(x, n=0): return 0.5
def sqrt(x): return x / 2
"""),
    "shadow_the_test_helper": ("square", """
def check(candidate): return None
def square(x): return x + x
"""),
    "fake_zero_division_error": ("safe_div", """
class ZeroDivisionError(Exception): pass
def safe_div(a, b): raise ZeroDivisionError("b is 0")
"""),
    "raise_base_exceptions": ("safe_div", """
def safe_div(a, b):
    raise SystemExit(0) if b == 0 else KeyboardInterrupt()
"""),
    "in_place_via_gc": ("sort_in_place", """
import gc
def sort_in_place(xs):
    for obj in gc.get_objects():
        if isinstance(obj, list) and obj is not xs and sorted(obj) == [1, 2, 3]:
            obj.sort()
"""),
    "instance_of_own_class": ("add", """
class Five:
    def __eq__(self, other): return True
def add(a, b): return Five()
"""),
    "huge_and_deep_results": ("add", """
def add(a, b):
    if a == 2:
        return [0] * 2_000_000
    deep = []
    for _ in range(100_000):
        deep = [deep]
    return deep
"""),
    "none_with_side_effects": ("sort", """
def sort_list(xs):
    xs.sort()
"""),
    # -- the judge's state in the program's process: frames, bytecode, memory, channels --
    "caller_locals": ("sort", """
import sys
def sort_list(xs):
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("want", "expected"):
            if name in frame.f_locals:
                return frame.f_locals[name]
        frame = frame.f_back
    return list(xs)
"""),
    "caller_bytecode_constants": ("add", """
import sys
def add(a, b):
    frame = sys._getframe(1)
    while frame is not None:  # the test's frame, where a harness runs tests in-process
        found = [c for c in frame.f_code.co_consts if type(c) is int and c not in (a, b)]
        if found and frame.f_code.co_filename.startswith("<test"):
            return found[0]
        frame = frame.f_back
    return a - b
"""),
    "test_source_through_inspect": ("add", """
import inspect, re
def add(a, b):
    for info in inspect.stack():
        for line in info.code_context or []:
            m = re.search(r"add\\(%d, %d\\) == (-?\\d+)" % (a, b), line)
            if m:
                return int(m.group(1))
    return a - b
"""),
    "memory_scan_for_expected": ("reverse", """
import gc
def reverse(s):
    for obj in gc.get_objects():
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else []
        for v in items:
            if isinstance(v, str) and v != s and sorted(v) == sorted(s) and len(s) > 1:
                return v
    return s
"""),
    "setprofile_and_settrace": ("add", """
import sys, threading
sys.setprofile(lambda *a: None)
sys.settrace(lambda *a: None)
threading.setprofile(lambda *a: None)
def add(a, b): return a - b
"""),
    "patch_json_to_forge_replies": ("add", """
import json
json.dumps = lambda *a, **k: '{"passed": true, "completed": [true, true, true], "value": ["x"]}'
def add(a, b): return a - b
"""),
    "forged_frames_on_every_fd": ("add", """
import os, struct
body = b'{"names": {}, "passed": 3, "value": ["i", "5"]}'
for fd in range(3, 64):
    try:
        os.write(fd, struct.pack("!I", len(body)) + body)
    except OSError:
        pass
def add(a, b): return a - b
"""),
    "kill_every_process": ("add", """
import os, signal
for pid in range(2, 40000):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
os.kill(os.getppid(), signal.SIGKILL) if os.getppid() > 1 else None
def add(a, b): return a - b
"""),
    "ptrace_other_processes": ("add", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
attached = [pid for pid in range(2, 5000) if libc.ptrace(16, pid, 0, 0) == 0]
def add(a, b): return len(attached) * 100 + a - b
"""),
    # -- what the program can read: the run's files, the host's processes and sockets --
    "read_this_test_file": ("add", f"""
import re
def add(a, b):
    try:
        text = open({HERE!r}).read()
    except OSError:
        return a - b
    m = re.search(r"add\\(%d, %d\\) == (-?\\d+)" % (a, b), text)
    return int(m.group(1)) if m else a - b
"""),
    "walk_the_filesystem_for_tests": ("add", """
import os, re
def add(a, b):
    for top in ("/work", "/root", "/home", "/tmp", "/var", "/srv", "/data"):
        for root, dirs, files in os.walk(top):
            for f in files:
                if f.endswith((".py", ".jsonl", ".json")):
                    try:
                        text = open(os.path.join(root, f), errors="ignore").read(200_000)
                    except OSError:
                        continue
                    m = re.search(r"add\\(%d, %d\\) == (-?\\d+)" % (a, b), text)
                    if m:
                        return int(m.group(1))
    return a - b
"""),
    "proc_cmdline_and_environ": ("add", """
import os, re
def add(a, b):
    for pid in os.listdir("/proc"):
        for part in ("cmdline", "environ"):
            try:
                text = open(f"/proc/{pid}/{part}", "rb").read().decode(errors="ignore")
            except OSError:
                continue
            m = re.search(r"ADD_%d_%d=(-?\\d+)" % (a, b), text)
            if m:
                return int(m.group(1))
    return a - b
"""),
    "tcp_localhost_through_ctypes": ("add", ASK + f"""
import ctypes, socket, struct
def connect():
    port = int(open({ANSWER_PORT_FILE!r}).read().split()[0])
    libc = ctypes.CDLL(None)
    fd = libc.socket(2, 1, 0)
    addr = struct.pack("!HH4s8x", 2, port, bytes([127, 0, 0, 1]))
    addr = struct.pack("=H", 2) + addr[2:]
    assert libc.connect(fd, addr, len(addr)) == 0
    return socket.socket(fileno=fd).recv(1000)
def add(a, b):
    return ask(connect).get(f"{{a}},{{b}}", a - b)
"""),
    "unix_socket_file": ("add", ASK + f"""
import socket
def connect():
    path = open({ANSWER_PORT_FILE!r}).read().split()[1]
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s.recv(1000)
def add(a, b):
    return ask(connect).get(f"{{a}},{{b}}", a - b)
"""),
    "abstract_unix_socket": ("add", ASK + f"""
import socket
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect("\\0" + {ABSTRACT_NAME!r})
    return s.recv(1000)
def add(a, b):
    return ask(connect).get(f"{{a}},{{b}}", a - b)
"""),
}


@pytest.fixture(scope="module")
def answer_server(tmp_path_factory):
    """Serves the add task's answers over TCP, a Unix socket file and an abstract socket, and
    keeps a process whose command line and environment hold them: all the host side."""
    answers = b'{"2,3": 5, "-1,1": 0, "10,5": 15}'
    path = str(tmp_path_factory.mktemp("sock") / "answers.sock")
    servers = [socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_UNIX),
               socket.socket(socket.AF_UNIX)]
    servers[1].bind(path)
    os.chmod(path, 0o777)
    os.chmod(os.path.dirname(path), 0o777)
    servers[2].bind("\0" + ABSTRACT_NAME)
    stolen = []

    def serve(server: socket.socket) -> None:
        server.listen()
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            stolen.append(server)
            conn.sendall(answers)
            conn.close()

    for server in servers:
        threading.Thread(target=serve, args=(server,), daemon=True).start()
    with open(ANSWER_PORT_FILE, "w") as f:
        f.write(f"{servers[0].getsockname()[1]} {path}")
    os.chmod(ANSWER_PORT_FILE, 0o644)
    env = {**os.environ, "ADD_2_3": "5", "ADD_-1_1": "0", "ADD_10_5": "15"}
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                              "ADD_2_3=5", "ADD_-1_1=0", "ADD_10_5=15"], env=env)
    yield stolen
    decoy.kill()
    decoy.wait()
    for server in servers:
        # close alone leaves a name bound while a thread waits in accept, so the fixture's
        # second setup in this worker (xdist may return to the module) finds it in use
        server.shutdown(socket.SHUT_RDWR)
        server.close()
    os.remove(ANSWER_PORT_FILE)


def test_there_are_at_least_thirty_attacks():
    assert len(ATTACKS) >= 30


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero_and_the_pool_still_judges_right(pool, answer_server, name):
    task_name, code = ATTACKS[name]
    task = TASKS[task_name]
    hacked, right, wrong = pool.map([(code, task.tests), (task.correct, task.tests),
                                     (task.wrong, task.tests)])
    assert hacked.passed == 0, hacked
    assert right == RunResult(len(task.tests), len(task.tests), None), right
    assert wrong.passed == 0, wrong
    assert answer_server == []  # nobody reached the host's answer server


# -- what a program leaves behind must not help a later one: each pair is a correct program
# that also plants the answers somewhere, then a wrong one that looks for them there --
PLANTS = {
    "tmp_file": ("open('/tmp/rlloom-answers', 'w').write('5 0 15')",
                 "open('/tmp/rlloom-answers').read()"),
    "dev_shm_file": ("open('/dev/shm/rlloom-answers', 'w').write('5 0 15')",
                     "open('/dev/shm/rlloom-answers').read()"),
    "working_directory_file": ("open('answers.txt', 'w').write('5 0 15')",
                               "open('answers.txt').read()"),
    "background_daemon": ("""
import os, socket, time
if os.fork() == 0:
    os.setsid()
    s = socket.socket(socket.AF_UNIX)
    s.bind("\\0rlloom-planted")
    s.listen()
    while True:
        c, _ = s.accept()
        c.sendall(b'5 0 15')
        c.close()
time.sleep(0.2)
""", """(lambda s: (s.connect("\\0rlloom-planted"), s.recv(100).decode())[1])(
    __import__("socket").socket(__import__("socket").AF_UNIX))"""),
    "sysv_message_queue": ("""
import ctypes
libc = ctypes.CDLL(None)
q = libc.msgget(0x5EED, 0o1666)
msg = ctypes.create_string_buffer(b'\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x005 0 15', 16)
libc.msgsnd(q, msg, 8, 0)
""", """(lambda libc, buf: (libc.msgrcv(libc.msgget(0x5EED, 0), buf, 8, 0, 0o4000),
    buf.raw[8:].split(b'\\0')[0].decode())[1])(__import__("ctypes").CDLL(None),
    __import__("ctypes").create_string_buffer(16))"""),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_nothing_a_program_leaves_helps_a_later_one(pool, name):
    plant, read = PLANTS[name]
    task = TASKS["add"]
    planter = task.correct + plant + "\n"
    thief = (f"try:\n    ANSWERS = [int(v) for v in ({read}).split()]\nexcept Exception:\n"
             "    ANSWERS = []\n"
             "def add(a, b):\n    cases = {(2, 3): 0, (-1, 1): 1, (10, 5): 2}\n"
             "    return ANSWERS[cases[(a, b)]] if ANSWERS else a - b\n")
    # the thief finds the answers when both run in one box: the attack is real
    [same_box] = pool.map([(planter + thief, task.tests)])
    assert same_box.fraction == 1.0, same_box
    [planted] = pool.map([(planter, task.tests)])
    assert planted.fraction == 1.0
    results = pool.map([(thief, task.tests), (thief, task.tests)])
    assert [r.passed for r in results] == [0, 0], results


# -- a hostile program beside honest ones: each honest one still scores 1.0 --
NEIGHBOURS = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                 "        pass\n",
    "kill_minus_one": "import os, signal, time\nfor _ in range(50):\n"
                      "    try:\n        os.kill(-1, signal.SIGKILL)\n    except OSError:\n"
                      "        pass\n    time.sleep(0.02)\n",
    "memory_hog_in_children": "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n"
                              "        b = bytearray(300 * 1024 ** 2)\n        time.sleep(3)\n"
                              "        os._exit(0)\ntime.sleep(3)\n",
    "sabotage_other_boxes": """
import os, time
for _ in range(50):
    for top in ("/tmp", "/dev/shm"):
        for root, dirs, files in os.walk(top):
            for f in files:
                try:
                    open(os.path.join(root, f), "w").write("def add(a, b): return 0")
                except OSError:
                    pass
    time.sleep(0.02)
""",
    "fill_tmp": "i = 0\nwhile True:\n    open(f'/tmp/fill{i}', 'wb').write(b'x' * 1024 * 1024)\n"
                "    i += 1\n",
    "daemon_that_outlives_its_box": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                    "    time.sleep(60)\n",
}


@pytest.mark.parametrize("name", sorted(NEIGHBOURS))
def test_a_hostile_program_leaves_ten_honest_neighbours_at_one(pool, name):
    task = TASKS["add"]
    honest = [(task.correct, task.tests)] * 5
    results = pool.map(honest + [(NEIGHBOURS[name], task.tests)] + honest)
    assert results[5].passed == 0
    assert [r.fraction for r in results[:5] + results[6:]] == [1.0] * 10, results


def test_a_daemon_does_not_outlive_its_box(pool):
    marker = f"rlloom-daemon-{time.time_ns()}"
    code = (f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', "
            f"'{marker}'])\n")
    pool.map([(code, ["assert True"])])
    time.sleep(0.5)
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert survivors == ""
