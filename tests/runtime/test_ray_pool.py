"""Ranks kept between runs (`ray/pool.py`): a run on kept ranks gives the numbers a run on
fresh ones gives, a rank that failed is never kept, and without RLLOOM_KEEP_RAY_WORKERS a
run leaves nothing behind."""
import json
import time
from types import SimpleNamespace

import pytest
from same_as_one_process import EXACT, assert_same, rows

from rlloom.cli import main
from rlloom.runtime.executor.ray import pool

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("ray_cluster")

# a TP copy for generation and dp2 training: meshes, process groups and weight resharding
PLAN = ["algo=grpo", *EXACT, "plan.layouts.actor.dp=2", "plan.layouts.generation.tp=2"]


def _kept() -> set[str]:
    return {a._actor_id.hex() for slot in pool._IDLE for a in slot.actors}


def test_kept_ranks_give_a_fresh_runs_numbers_and_a_failed_rank_is_not_kept(
        tmp_path, tiny, monkeypatch, capsys):
    pool.evict()
    main(["train", *tiny, *PLAN, f"run_dir={tmp_path / 'fresh'}"])
    first = _kept()
    assert len(first) == 2  # one slot per rank on a one-node cluster
    main(["train", *tiny, *PLAN, f"run_dir={tmp_path / 'kept'}"])
    assert _kept() == first  # the same processes served the second run
    assert_same(rows(tmp_path / "fresh"), rows(tmp_path / "kept"))

    # rank 1 killed during step 2: neither it nor its peer (inside a collective) is kept
    monkeypatch.setenv("RLLOOM_RAY_FAULT", "kill:all/1:2")
    main(["train", *tiny, *PLAN, f"run_dir={tmp_path / 'killed'}", "--worker-timeout", "120",
          "--max-restarts", "1"])
    assert "worker rank 1 of group 'all'" in capsys.readouterr().out
    assert len(_kept()) == 2 and not _kept() & first  # the restart's ranks, fresh
    failure = json.loads((tmp_path / "killed" / "failures.jsonl").read_text())
    assert failure["rank"] == 1 and failure["step"] == 2
    assert_same(rows(tmp_path / "fresh"), rows(tmp_path / "killed"))

    monkeypatch.delenv("RLLOOM_RAY_FAULT")
    monkeypatch.delenv(pool.KEEP_ACROSS_RUNS)
    main(["train", *tiny, *PLAN, f"run_dir={tmp_path / 'alone'}"])
    assert not pool._IDLE  # a run that keeps nothing across runs evicts what it kept


def test_a_clean_runs_rank_that_is_slow_to_close_is_still_kept():
    """On a busy machine a rank can take seconds to close (Ray runs its workers at niceness
    15): a clean run's rank whose close outlasts the wait of a failed run's teardown
    (PING_S) is still kept, not killed and started again by the next group."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from rlloom.runtime.executor.ray.cluster import WorkerGroup, remove_groups
    from rlloom.runtime.executor.ray.executor import PING_S

    @ray.remote(num_cpus=1)
    class SlowToClose:
        def close(self) -> None:
            time.sleep(PING_S + 1)

    pg = placement_group([{"CPU": 1.0}])
    ray.get(pg.ready())
    rank = SlowToClose.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)
                               ).remote()
    slot = pool.Slot(pg, {"CPU": 1.0}, [rank], ["node"], [0])
    remove_groups([WorkerGroup(SimpleNamespace(name="slow"), [slot], ["ip"], [])], PING_S,
                  keep=True)
    kept = slot in pool._IDLE
    if kept:
        pool._IDLE.remove(slot)
    pool.release(slot)
    assert kept
