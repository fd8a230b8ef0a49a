import gc
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
from tiny_run import TINY

# The suite starts ~100 Python processes (Ray ranks, torchrun and spawned ranks, CLI runs).
# The README's command installs without compiling (`pip install --no-compile`: pip would
# compile every module of every package on one core, ~33 CPU-s); the processes compile what
# they import, once, and write the bytecode for the processes after them, even where
# PYTHONDONTWRITEBYTECODE is set (this project's CI image sets it), which would otherwise make
# every process compile its imports again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Processes the tests start from Python (the parallel harness's ranks, the weight channel's
# members) fork from a forkserver that imported these once: a rank that imported them itself
# would spend ~2 CPU-s on it, more than its work; the forkserver, unlike plain fork, holds
# none of the test process's OpenMP threads.
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed.tensor", "torch._dynamo", "pytest", "rlloom.models.transformer",
     "rlloom.parallel.apply", "rlloom.runtime.ranks", "rlloom.runtime.executor.weight_channel"])

# Markers, set here by where a test lives so that no test can miss one (pyproject lists them):
# ray (starts or joins a Ray instance), vllm (the vLLM backend), slow (a module whose tests
# take seconds each: multi-process groups, torchrun, whole runs, benchmarks). The edit-test
# loop runs `pytest -m "not slow and not ray and not vllm" -n auto`.
SLOW = {"test_ray_groups.py", "test_plan_contract.py", "test_torchrun.py", "test_ray_faults.py",
        "test_worked_example.py", "test_validate.py", "test_bench_hw.py", "test_humaneval.py",
        "test_ray_runtime.py", "test_parallel_equivalence.py", "test_train_e2e.py",
        "test_faults.py", "test_code_attacks.py", "test_partial_rollouts.py", "test_lora_run.py",
        "test_published_runs.py", "test_bench_layouts.py", "test_presets.py",
        "test_multinode.py", "test_rehearsal.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`-n auto` steals work: a worker that runs out takes half of the other's queue, instead
    of idling while the other finishes the long tests it was dealt (~45 s of one core on
    this suite with xdist's default `load`)."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import WorkStealingScheduling
        return WorkStealingScheduling(config, log)
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules every test module imported live for the whole session: frozen, the cyclic
    collector stops walking them, which the many in-process runs would otherwise pay for in
    every full collection (~30% of a tiny run's CPU)."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        fixtures = getattr(item, "fixturenames", ())
        if name.startswith("test_ray_") or {"ray_cluster", "ns_cluster"} & set(fixtures):
            item.add_marker(pytest.mark.ray)
        if "vllm" in name:
            item.add_marker(pytest.mark.vllm)
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
    # Slow modules first, ray's first among them: xdist deals tests out in this order, so the
    # long ones overlap each other instead of one of them running last beside an idle worker.
    # test_ray_pool.py evicts the ranks the tests before it kept: last of the Ray tests, so
    # that none after it starts its ranks again.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("ray") is None,
                                 Path(str(item.fspath)).name == "test_ray_pool.py"))

@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Built-in models are cached per test session, never in the user's home."""
    monkeypatch.setenv("RLLOOM_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def tiny() -> list[str]:
    return list(TINY)
