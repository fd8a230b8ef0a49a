"""A box's cgroup is named for the judge's pid and a counter; a judge killed before it removed
its spare box's cgroup leaves the directory behind, and a later judge given the same pid by
the kernel must still get its box (a suite run failed with EEXIST on one of 671 left)."""
from rlloom.rewards import cgroups
from rlloom.rewards.cgroups import BoxCgroup


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
