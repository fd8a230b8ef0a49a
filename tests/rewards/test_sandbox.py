import os
import resource
import socket
import tempfile
import threading
import uuid

import pytest

from rlloom.rewards import sandbox
from rlloom.rewards.sandbox import RunResult, SandboxLimits, SandboxPool, run_program

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
LIMITS = SandboxLimits(cpu_s=1, wall_s=2.0)
ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, limits=LIMITS) as p:
        yield p


def hostile(pool: SandboxPool, code: str, tests: list[str] | None = None,
            reason: bool = True) -> RunResult:
    """Runs a hostile program, then checks that a correct one still passes in the same pool."""
    result, after = pool.map([(code, tests or ADD_TESTS), (ADD, ADD_TESTS)])
    assert after == RunResult(2, 2, None)
    assert result.fraction == 0.0 and (result.reason or not reason), result
    return result


def test_correct_program_passes_all(pool):
    assert pool.map([(ADD, ADD_TESTS)]) == [RunResult(2, 2, None)]


def test_partially_correct_program_scores_half():
    result = run_program("def add(a, b):\n    return a * b\n",
                         ["assert add(2, 2) == 4", "assert add(2, 3) == 5"], LIMITS)
    assert result.fraction == 0.5 and result.reason is None


def test_syntax_error():
    assert run_program("def add(a, b) return a", ADD_TESTS, LIMITS).reason == "syntax error"


def test_printed_fake_result_line_cannot_forge_a_pass(pool):
    code = ("print('result 2 2 -')\nprint('0' * 32 + ' result 2 2 -')\n"
            "print('0' * 32 + ' status -')\ndef add(a, b):\n    return None\n")
    assert pool.map([(code, ADD_TESTS)])[0].fraction == 0.0


def test_workdir_is_removed(monkeypatch):
    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp",
                        lambda **kw: made.append(real(**kw)) or made[-1])
    run_program("open('scratch.txt', 'w').write('x')\n" + ADD, ADD_TESTS, LIMITS)
    assert made and not os.path.exists(made[0])


def test_infinite_loop(pool):
    assert hostile(pool, "while True:\n    pass\n").reason in ("timeout", "cpu limit")


def test_sleeping_program_times_out(pool):
    assert hostile(pool, "import time\ntime.sleep(30)\n").reason == "timeout"


@pytest.mark.skipif(not ROOT, reason="RLIMIT_NPROC counts all of a normal user's processes")
def test_process_count_is_limited_before_fork_bomb(pool):
    # Harmless containment check first: most of 200 sleepers must fail to start.
    code = ("import subprocess\nfails = 0\nfor _ in range(200):\n    try:\n"
            "        subprocess.Popen(['sleep', '30'])\n    except OSError:\n        fails += 1\n")
    result = run_program(code, ["assert fails >= 150"], LIMITS)
    assert result == RunResult(1, 1, None)
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    hostile(pool, bomb)


def test_memory_bomb(pool):
    assert hostile(pool, "x = bytearray(4 * 1024 ** 3)\n" + ADD).reason == "memory limit"


def test_cannot_write_outside_workdir(pool, tmp_path):
    target = f"/tmp/rlloom_pwned_{uuid.uuid4().hex}"
    hostile(pool, f"open({target!r}, 'w').write('x')\n" + ADD)
    assert not os.path.exists(target)
    if ROOT:
        # Bypasses the audit hook: only the uid drop stops it.
        tmp_path.chmod(0o755)
        root_owned = str(tmp_path / "pwned")
        code = (f"import ctypes\nfd = ctypes.CDLL(None).open({root_owned!r}.encode(), 0o101, 0o644)"
                "\nassert fd >= 0\n" + ADD)
        hostile(pool, code)
        assert not os.path.exists(root_owned)


def test_parent_environment_is_not_visible(pool, monkeypatch):
    monkeypatch.setenv("RLLOOM_SECRET", "s3cret")
    code = "import os\nprint(dict(os.environ))\nleak = os.environ.get('RLLOOM_SECRET')\n"
    # The program runs fine; only the test that needs the secret fails.
    hostile(pool, code, ["assert leak == 's3cret'"], reason=False)


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


@pytest.mark.skipif(not ROOT, reason="network namespaces need root here")
def test_network_namespace_has_only_loopback():
    code = "import socket\nnames = [n for _, n in socket.if_nameindex()]\n"
    assert run_program(code, ["assert names == ['lo']"], LIMITS).fraction == 1.0


def test_printing_gigabytes_hits_output_limit(pool):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)\n"
    assert hostile(pool, code).reason == "output limit"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
