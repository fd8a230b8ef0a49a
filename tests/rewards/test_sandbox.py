"""The sandbox's behaviour on honest and misbehaving programs: results, limits, isolation,
stdin/stdout tests, and refusing to run where the isolation asked for is missing."""
import json
import os
import socket
import subprocess
import threading
import uuid
from dataclasses import replace

import pytest
from sandbox_setup import LIMITS

from rlloom.data.prompts import read_prompt_file
from rlloom.rewards import box, judge, sandbox
from rlloom.rewards.box import BoxConfig
from rlloom.rewards.sandbox import RunResult, SandboxPool, SandboxUnavailable, run_program
from rlloom.rewards.tasks import task_terms

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]


def hostile(pool: SandboxPool, code: str, tests: list | None = None,
            reason: bool = True) -> RunResult:
    """Runs a hostile program, then checks that a correct one still passes in the same pool."""
    result, after = pool.map([(code, tests or ADD_TESTS), (ADD, ADD_TESTS)])
    assert after == RunResult(2, 2, None)
    assert result.fraction == 0.0 and (result.reason or not reason), result
    return result


def test_correct_program_passes_all(pool):
    assert pool.map([(ADD, ADD_TESTS)]) == [RunResult(2, 2, None)]


def test_partially_correct_program_scores_half(pool):
    [result] = pool.map([("def add(a, b):\n    return a * b\n",
                          ["assert add(2, 2) == 4", "assert add(2, 3) == 5"])])
    assert result.fraction == 0.5 and result.reason is None


def test_syntax_error(pool):
    assert pool.map([("def add(a, b) return a", ADD_TESTS)])[0].reason == "syntax error"


def test_run_program_judges_one_program():
    assert run_program(ADD, ADD_TESTS, LIMITS) == RunResult(2, 2, None)


def test_what_the_program_prints_comes_back(pool):
    [result] = pool.map([("print('hello')\n" + ADD, ADD_TESTS)])
    assert result == RunResult(2, 2, None, "hello\n")


def test_every_assert_shape_is_judged_on_plain_values(pool):
    code = ("import math\n"
            "def sqrt(x):\n    return math.sqrt(x)\n"
            "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n"
            "def div(a, b):\n    if b == 0:\n        raise ValueError('b is zero')\n"
            "    return a / b\n"
            "def bump(xs):\n    xs.append(len(xs))\n"
            "def apply(f, x):\n    return f(x)\n"
            "class Counter:\n    def __init__(self, start):\n        self.n = start\n"
            "    def step(self):\n        self.n += 1\n        return self.n\n"
            "LIMIT = 10\n")
    tests = ["assert abs(sqrt(2.0) - 1.41421356) < 1e-6",
             "import math\nassert math.isclose(sqrt(9.0), 3.0)",
             "want = [2, 4]\nassert evens([1, 2, 3, 4]) == want",
             "for xs, want in [([1], []), ([2, 3], [2])]:\n    assert evens(xs) == want",
             "assert 4 in evens([3, 4, 5])",
             "try:\n    div(1, 0)\nexcept ValueError as e:\n    assert str(e) == 'b is zero'\n"
             "else:\n    raise AssertionError('no error')",
             "xs = [7]\nassert bump(xs) is None\nassert xs == [7, 1]",
             "def check(candidate):\n    assert candidate([6]) == [6]\ncheck(evens)",
             "assert apply(sqrt, 16.0) == 4.0",
             "c = Counter(3)\nassert c.step() == 4 and c.step() == 5",
             "assert LIMIT == 10"]
    assert pool.map([(code, tests)]) == [RunResult(len(tests), len(tests), None)]


def test_results_that_are_not_plain_data_fail_that_call(pool):
    code = ("def gen(n):\n    return (i for i in range(n))\n"
            "def ok(n):\n    return list(range(n))\n")
    [result] = pool.map([(code, ["assert list(gen(2)) == [0, 1]", "assert ok(2) == [0, 1]"])])
    assert (result.passed, result.total) == (1, 2)


def test_stdin_stdout_cases(pool):
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    cases = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4", "output": "6"},
             {"input": "1 1\n", "output": "3\n"}]
    assert pool.map([(code, cases)]) == [RunResult(2, 3, None)]
    # every case is a fresh run: no state carries over
    counter = "import os\nopen('/tmp/n', 'a').write('x')\nprint(len(open('/tmp/n').read()))\n"
    assert pool.map([(counter, [{"input": "", "output": "1"}] * 3)])[0].passed == 3


def test_code_task_scores_stdin_stdout_rows(pool, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Add two numbers.", "tests": [
        {"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]}) + "\n")
    problems = read_prompt_file(rows, "code") * 3
    responses = ["print(sum(map(int, input().split())))", "print(3)", "print(3"]
    terms = task_terms(problems, responses, "code", pool)
    assert terms == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 1.0, 0.0]}  # all must pass
    terms = task_terms(problems, responses, "code", pool, code_score="fraction")
    assert terms == {"correct": [1.0, 0.5, 0.0], "format": [1.0, 1.0, 0.0]}
    with pytest.raises(ValueError, match="code_score must be one of"):
        task_terms(problems, responses, "code", pool, code_score="mean")


@pytest.mark.parametrize("compare, got, want, same", [
    ("exact", "1 2\n3  \n\n", "1 2\n3", True),
    ("exact", "1  2\n", "1 2\n", False),
    ("tokens", "1  2\n3", "1 2 3\n", True),
    ("tokens", "1.0", "1", False),
    ("float", "0.3333333 2", "0.33333333 2", True),
    ("float", "0.34 2", "0.33333333 2", False),
    ("float", "abc", "abd", False),
    # integers on both sides are exact, however large: the tolerance is for floats
    ("float", "1000000001", "1000000000", False),
    ("float", "-123456789012345678901", "-123456789012345678900", False),
    ("float", "+0042 7", "42 7", True),
    ("float", "1000000000.5", "1000000000", True),
    ("float", "1e9", "1000000001", True),
])
def test_output_comparisons(compare, got, want, same):
    assert judge.same_output(got, want, compare, 1e-6) is same


def test_stdio_case_that_crashes_or_hangs_fails(pool):
    code = "x = input()\nif x == 'loop':\n    while True:\n        pass\nprint(1 // int(x))\n"
    cases = [{"input": "1", "output": "1"}, {"input": "0", "output": "0"},
             {"input": "loop", "output": "0"}]
    [result] = pool.map([(code, cases)])
    assert result.passed == 1 and result.reason in ("timeout", "killed by signal 9")


def test_run_script_returns_what_the_program_wrote(pool):
    result = pool.run_script("import sys\nprint(input()[::-1])\nsys.exit(3)\n", stdin="abc\n")
    assert (result.stdout, result.exit, result.reason) == ("cba\n", 3, None)


def test_infinite_loop(pool):
    assert hostile(pool, "while True:\n    pass\n").reason in ("timeout", "cpu limit")


def test_a_cpu_kill_on_a_shared_core_is_the_cpu_limit():
    """RLIMIT_CPU's SIGKILL comes on tick-sampled time: a busy loop under a 1 s limit, beside
    another test suite, died after 0.904 s of the exact time wait4 reports, and was reported
    as "killed by signal 9". A SIGKILL well short of the limit stays what it is."""
    from rlloom.rewards.box import SandboxLimits, _describe
    limits = SandboxLimits(cpu_s=1)
    assert _describe(-9, 0.904, False, limits) == "cpu limit"
    assert _describe(-9, 0.3, False, limits) == "killed by signal 9"
    assert _describe(-9, 0.904, True, limits) == "memory limit"


def test_sleeping_program_times_out(pool):
    assert hostile(pool, "import time\ntime.sleep(30)\n").reason == "timeout"


def test_hung_call_inside_a_test_times_out(pool):
    code = "def add(a, b):\n    import time\n    time.sleep(30)\n"
    assert hostile(pool, code).reason == "timeout"


def test_memory_bomb_in_one_process(pool):
    assert hostile(pool, "x = bytearray(4 * 1024 ** 3)\n" + ADD).reason == "memory limit"


def test_memory_is_bounded_per_program_not_per_process():
    # six children of 200 MB each: every process is under RLIMIT_AS (512 MB), the program
    # is not under its cgroup's 512 MB. The kernel kills children, the program waits on and
    # ends by its time, and the box reports the kill; a wall budget of seconds, so that a
    # loaded machine's slow forks and page zeroing cannot end it before the kill
    code = ("import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
            "        b = bytearray(200 * 1024 ** 2)\n        time.sleep(30)\n        os._exit(0)\n"
            "time.sleep(30)\n" + ADD)
    with SandboxPool(workers=1, limits=replace(LIMITS, wall_s=5.0)) as pool:
        assert hostile(pool, code).reason == "memory limit"


def test_fork_bomb_is_contained(pool):
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    hostile(pool, code)


def test_processes_are_limited_per_program(pool):
    # the box has no programs but its interpreter: its children are more interpreters
    code = ("import subprocess, sys\nfails = 0\nfor _ in range(40):\n    try:\n"
            "        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "    except OSError:\n        fails += 1\n")
    [result] = pool.map([(code, ["assert 40 - 16 <= fails <= 40 - 8"])])
    assert result == RunResult(1, 1, None)


def test_nothing_is_written_outside_the_box(pool, tmp_path):
    tmp_path.chmod(0o777)
    targets = [f"/tmp/rlloom_pwned_{uuid.uuid4().hex}", str(tmp_path / "pwned")]
    for target in targets:
        code = (f"import os\nfor f in (lambda p: open(p, 'w').write('x'), os.mkdir,\n"
                f"          lambda p: os.symlink('/etc/passwd', p)):\n"
                f"    try:\n        f({target!r})\n    except OSError:\n        pass\n"
                f"import ctypes\n"
                f"ctypes.CDLL(None).open({target!r}.encode() + b'2', 0o101, 0o644)\n")
        hostile(pool, code, reason=False)
        assert not os.path.exists(target) and not os.path.exists(target + "2")


def test_parent_environment_is_not_visible(pool, monkeypatch):
    monkeypatch.setenv("RLLOOM_SECRET", "s3cret")
    code = "import os\nleak = os.environ.get('RLLOOM_SECRET')\ndef add(a, b):\n    return leak\n"
    hostile(pool, code, reason=False)


def test_network_is_unreachable(pool):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:  # timed out, or closed below: nobody connected
            pass

    waiter = threading.Thread(target=accept, daemon=True)
    waiter.start()
    code = ("import socket\nfor addr in [('1.1.1.1', 53), ('127.0.0.1', %d)]:\n"
            "    socket.create_connection(addr, timeout=1).close()\n" % port)
    hostile(pool, code + ADD)
    waiter.join(4)
    server.close()
    assert not accepted


def test_the_box_has_its_own_network_pids_root_and_uid(pool, tmp_path):
    secret = tmp_path / "rows.jsonl"
    secret.write_text("answers")
    secret.chmod(0o644)
    code = ("import os, socket\nnames = [n for _, n in socket.if_nameindex()]\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            f"seen = [os.path.exists(p) for p in ({__file__!r}, {str(secret)!r}, '/etc')]\n"
            "uid = os.getuid()\n")
    tests = ["assert names == ['lo']", "assert pids == [1]", "assert uid >= 2 ** 30",
             "assert seen == [False, False, False]"]
    [result] = pool.map([(code, tests)])
    assert result == RunResult(len(tests), len(tests), None), result


def test_printing_gigabytes_hits_output_limit(pool):
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)\n"
    assert hostile(pool, code).reason == "output limit"


def test_a_judge_that_hangs_on_a_test_is_replaced(pool):
    [result] = pool.map([(ADD, ["while True:\n    pass"])])
    assert result.reason == "judge timeout"
    assert pool.map([(ADD, ADD_TESTS)]) == [RunResult(2, 2, None)]


def test_missing_isolation_refuses_to_score(monkeypatch):
    """When the judge reports that the box cannot be built, the pool refuses with the fix."""
    monkeypatch.setattr(sandbox._Judge, "run",
                        lambda self, line, timeout_s: {"unavailable": "cgroups: read-only"})
    with pytest.raises(SandboxUnavailable, match="reward.sandbox_isolation=namespaces"):
        SandboxPool(1, LIMITS)


def test_judge_reports_a_cgroup_it_cannot_make(monkeypatch):
    def no_cgroups():
        raise OSError("no cgroup hierarchy with the memory and pids controllers is mounted")
    monkeypatch.setattr("rlloom.rewards.cgroups._parents", no_cgroups)
    boxes = judge.Boxes(BoxConfig.for_host("strict"))
    line = judge.job("asserts", ADD, LIMITS, tests=ADD_TESTS)
    assert judge.run_job(line, boxes) == {
        "unavailable": "no cgroup hierarchy with the memory and pids controllers is mounted"}
    # the weaker mode, when asked for explicitly, runs without them
    boxes = judge.Boxes(BoxConfig.for_host("namespaces"))
    assert judge.run_job(line, boxes)["passed"] == 2
    boxes.close()


def test_bad_isolation_name():
    with pytest.raises(ValueError, match="strict"):
        SandboxPool(1, LIMITS, isolation="docker")


UNPRIVILEGED = """
from rlloom.rewards.sandbox import SandboxPool, SandboxUnavailable
for isolation in ("strict", "namespaces"):
    try:
        with SandboxPool(1, isolation=isolation) as p:
            code = "import os\\nuid = os.getuid()\\nseen = os.path.exists('/etc')"
            print(isolation, p.map([(code, ["assert uid == 0", "assert not seen"])])[0].passed)
    except SandboxUnavailable as e:
        print(isolation, "refused:", e)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv")
                    or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to become another user, setpriv and /usr/bin/python3")
def test_an_unprivileged_user_gets_a_user_namespace_or_a_clear_refusal():
    """As uid 65534: strict (no writable cgroup) is refused naming the weaker mode, and
    namespaces runs the program as root of its own user namespace, in its own root."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(sandbox.__file__)))
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "env", f"PYTHONPATH={repo}", "HOME=/tmp", "/usr/bin/python3",
                          "-c", UNPRIVILEGED], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("strict refused:") and "sandbox_isolation=namespaces" in lines[0]
    assert lines[1] == "namespaces 2", out


def test_box_uids_come_from_a_counter_not_from_pids(tmp_path, monkeypatch):
    counter = tmp_path / "uids"
    monkeypatch.setattr(box, "_UID_COUNTER", str(counter))
    assert [box.next_uid() for _ in range(3)] == [box.UID_BASE, box.UID_BASE + 1,
                                                  box.UID_BASE + 2]
    counter.write_bytes((box.UID_SPAN - 1).to_bytes(8, "big"))
    assert box.next_uid() == box.UID_BASE  # wraps only after 2^31 boxes
    if os.geteuid() == 0:
        os.chown(counter, 65534, 65534)
        with pytest.raises(OSError, match="belongs to another user"):
            box.next_uid()


def test_a_host_without_libseccomp_is_told_what_to_install(monkeypatch):
    from rlloom.rewards import seccomp
    monkeypatch.setattr(seccomp.ctypes.util, "find_library", lambda name: "libnot-there.so.9")
    with pytest.raises(OSError, match="apt install libseccomp2"):
        seccomp.build()
