"""Replies no judge can be hurt by, and exceptions that cannot steer its loops. A program runs
in the box's server process, so it can write any reply it likes on the reply pipe (fd 4): each
forged reply below fails its program (0) within its time, leaves the judge's memory bounded,
and the same judge then scores the correct program 1 and a wrong one 0."""
import psutil
import pytest
from sandbox_setup import LIMITS

from rlloom.rewards.sandbox import SandboxPool

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]
CORRECT, WRONG = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"
_FORGE = ("import json, os, struct, time\n"
          "def forge(reply):\n"
          "    body = reply if type(reply) is bytes else json.dumps(reply).encode()\n"
          "    os.write(4, struct.pack('!I', len(body)) + body)\n"
          "M = (1 << 61) - 1  # ints k * M all hash to 0\n"
          "COLLIDING = [['i', format(k * M, 'x')] for k in range(1, 60001)]\n")


def _at_load(reply: str) -> str:
    return f"{_FORGE}forge({reply})\ntime.sleep(0.2)\n{CORRECT}"


def _at_call(reply: str) -> str:
    return f"{_FORGE}def add(a, b):\n    forge({reply})\n    time.sleep(0.2)\n    return a + b\n"


HOSTILE = {
    # the load reply's shape
    "names_not_a_table": _at_load("{'names': 5}"),
    "names_a_list": _at_load("{'names': [['add', 'function']]}"),
    "fail_not_text": _at_load("{'fail': {'x': 1}}"),
    "names_with_a_colliding_set": _at_load("{'names': {'add': ['S', COLLIDING]}}"),
    "names_too_many": _at_load("{'names': {str(i): ['n'] for i in range(200_000)}}"),
    # a call's reply
    "handle_flood": _at_call("{'value': ['l', [['h', 1]] * 1_500_000]}"),
    "colliding_set": _at_call("{'value': ['S', COLLIDING]}"),
    "colliding_dict_keys": _at_call("{'value': ['d', [x for c in COLLIDING for x in (c, ['n'])]]}"),
    "colliding_tuples": _at_call("{'value': ['F', [['t', [c, c]] for c in COLLIDING]]}"),
    "deep_nesting": _at_call("b'{\"value\": ' + b'[\"l\", [' * 5000 + b']]' * 5000 + b'}'"),
    "raised_not_a_report": _at_call("{'raised': 12}"),
    "value_not_a_tag": _at_call("{'value': {'a': 1}}"),
    "args_not_a_list": _at_call("{'value': ['n'], 'args': 7}"),
}


def _judge_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children()
            if "rlloom.rewards.judge" in " ".join(p.cmdline())}


def _peak_mb(pid: int) -> float:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return int(status["VmHWM"].split()[0]) / 1024


@pytest.fixture(scope="module")
def one_judge():
    before = _judge_pids()
    with SandboxPool(workers=1, limits=LIMITS) as pool:
        [pid] = _judge_pids() - before
        yield pool, pid


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_forged_reply_fails_its_program_and_never_the_judge(one_judge, name):
    pool, pid = one_judge
    [hostile] = pool.map([(HOSTILE[name], TESTS)])
    # decoding is linear: building a set of 60,000 ints of one hash took the judge past its
    # time (a judge timeout, and a judge replaced)
    assert hostile.passed == 0 and hostile.reason != "judge timeout", hostile
    assert [r.fraction for r in pool.map([(CORRECT, TESTS), (WRONG, TESTS)])] == [1.0, 0.0]
    assert _judge_pids() >= {pid}  # the same judge, not a replacement
    assert _peak_mb(pid) < 200, f"the judge peaked at {_peak_mb(pid):.0f} MB"  # 590 before


STEERED = [  # test shapes that end early, as passed, on a StopIteration from the program
    "assert all(map(lambda c: add(*c[:2]) == c[2], [(2, 3, 5), (-1, 1, 0), (10, 5, 15)]))",
    "for got, want in zip(map(lambda c: add(*c), [(2, 3), (10, 5), (-1, 1)]), [5, 15, 0]):\n"
    "    assert got == want",
    "assert not any(map(lambda c: add(*c) != c[0] + c[1], [(2, 3), (10, 5)]))",
]


@pytest.mark.parametrize("raised", ["StopIteration", "StopAsyncIteration",
                                    "type('Stop', (StopIteration,), {})"])
def test_a_stop_iteration_from_the_program_is_its_error(pool, raised):
    program = f"def add(a, b):\n    if (a, b) != (2, 3):\n        raise {raised}()\n    return 5\n"
    [result] = pool.map([(program, STEERED)])
    assert result.passed == 0, result
    assert [r.passed for r in pool.map([(CORRECT, STEERED), (WRONG, STEERED)])] == [3, 0]


def test_a_program_opens_at_most_its_files(pool):
    code = ("opened = []\ntry:\n    while len(opened) < 100_000:\n"
            "        opened.append(open('/dev/null'))\nexcept OSError:\n    pass\n"
            "COUNT = len(opened)\n")
    [result] = pool.map([(code, ["assert 200 < COUNT < 256"])])
    assert result.passed == 1, result
