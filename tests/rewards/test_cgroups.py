"""A box's cgroup is named for the judge's pid and a counter; a judge killed before it removed
its spare box's cgroup leaves the directory behind, and a later judge given the same pid by
the kernel must still get its box (a suite run failed with EEXIST on one of 671 left). Since,
a judge killed or closed by its pool leaves none."""
import psutil

from rlloom.rewards import cgroups
from rlloom.rewards.box import SandboxLimits
from rlloom.rewards.cgroups import BoxCgroup
from rlloom.rewards.sandbox import SandboxPool


def test_a_cgroup_left_by_a_dead_process_of_the_same_pid_is_replaced(tmp_path, monkeypatch):
    parents = {c: tmp_path / c for c in ("memory", "pids")}
    for d in parents.values():
        d.mkdir()
    monkeypatch.setattr(cgroups, "_parents", lambda: parents)
    for d in parents.values():  # what the dead judge left: an empty cgroup of that name
        (d / "rlloom-box-7-1").mkdir()
    box = BoxCgroup.create("rlloom-box-7-1", 512 << 20, 17)
    assert (box.pids / "pids.max").read_text() == "17"
    assert (box.memory / "memory.limit_in_bytes").read_text() == str(512 << 20)


def _left_by(pids: set[int]) -> list[str]:
    return sorted({d.name for parent in set(cgroups._parents().values())
                  for pid in pids for d in [*parent.glob(f"rlloom-box-{pid}-*"),
                                            parent / f"rlloom-judge-{pid}"] if d.exists()})


def _judge_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children()
            if "rlloom.rewards.judge" in " ".join(p.cmdline())}


def test_no_cgroup_survives_a_judge_kill_or_a_pool_close():
    before, mine = _judge_pids(), set()
    limits = SandboxLimits(cpu_s=1, wall_s=1.0)
    with SandboxPool(workers=1, limits=limits) as pool:
        mine |= _judge_pids() - before
        [first] = mine
        # the judge's own cgroup and its spare box's exist while it runs
        assert {f"rlloom-judge-{first}", f"rlloom-box-{first}-2"} <= set(_left_by(mine))
        [hung] = pool.map([("x = 1", ["while True:\n    pass"])])  # a test that never ends
        assert hung.reason == "judge timeout"
        assert _left_by(mine) == []  # killed, and its cgroups removed
        assert [r.fraction for r in pool.map([("x = 1", ["assert x == 1"])] * 2)] == [1.0, 1.0]
        mine |= _judge_pids() - before
        assert len(mine) == 2 and f"rlloom-judge-{max(mine - {first})}" in _left_by(mine)
    assert _left_by(mine) == []
