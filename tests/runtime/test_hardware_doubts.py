"""`rlloom bench hw` knows when it is disturbed: each microbenchmark repeats until its batches
agree or its budget ends and reports their spread; the load other processes put on the machine
is measured; a file measured noisily, under load or by another rlloom warns whoever prices
with it."""
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest

from rlloom.perf.model.hardware import (
    HardwareWarning,
    hardware,
    installed_version,
    load_hardware,
    measurement_doubts,
)
from rlloom.runtime import hardware_bench
from rlloom.runtime.hardware_bench import OthersLoad, _best_seconds


class Clock:
    """A perf_counter that only the benchmarked function moves: each call takes the next of
    `durations` seconds."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        return self.now

    def fn(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


def test_agreeing_batches_stop_at_three(monkeypatch):
    """Every call 1 s, batches of >= 1 s: the growth batch and two more agree (spread 0), so
    4 calls in all (warm-up, growth, 2 batches)."""
    clock = Clock([1.0])
    monkeypatch.setattr(hardware_bench.time, "perf_counter", clock.perf_counter)
    assert _best_seconds(clock.fn, min_time=1.0, budget_s=5.0) == (1.0, 0.0)
    assert clock.calls == 4


def test_disagreeing_batches_repeat_until_the_budget_and_report_their_spread(monkeypatch):
    """Warm-up and growth batch 1 s, every later batch 2 s: best 1, median 2, spread
    (2 - 1) / 1 = 1.0; batches go on while under 5 s of budget: 2, 4, then 6 > 5 stops after
    the third, 5 calls in all."""
    clock = Clock([1.0, 1.0, 2.0])
    monkeypatch.setattr(hardware_bench.time, "perf_counter", clock.perf_counter)
    assert _best_seconds(clock.fn, min_time=1.0, budget_s=5.0) == (1.0, 1.0)
    assert clock.calls == 5


def test_a_rank_goes_on_while_another_wants_more(monkeypatch):
    """Ranks timing a collective must call it equally often: `agree` answers for all of them.
    Here the other rank wants more for the first 3 decisions (all in the growth phase): the
    batch grows to 8 calls although 1 would do, then 2 more batches agree; 1 + 15 + 16 = 32
    calls in all."""
    clock = Clock([1.0])
    monkeypatch.setattr(hardware_bench.time, "perf_counter", clock.perf_counter)
    asked = []

    def agree(more):
        asked.append(more)
        return more or len(asked) <= 3
    assert _best_seconds(clock.fn, min_time=1.0, budget_s=5.0, agree=agree) == (1.0, 0.0)
    assert clock.calls == 32 and asked == [False, False, False, False, True, False]


def test_busy_processes_show_as_other_load():
    """Two processes spinning on the 2 cores while this one sleeps: most of the machine's
    CPU time is theirs (whatever else runs only adds to it)."""
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(2)]
    try:
        time.sleep(0.5)  # both spinning
        with OthersLoad() as load:
            time.sleep(1.5)
    finally:
        for p in busy:
            p.wait()
    assert load.share > 0.5


def _measured(**extra):
    return replace(hardware("h100"), name="local", rlloom_version=installed_version(),
                   extra={"measured_at": 1.7e9, "spread_max": 0.02, "other_load": 0.05,
                          **extra})


def test_a_clean_measurement_loads_without_a_word(tmp_path):
    path = tmp_path / "hw.json"
    _measured().save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_hardware(path).rlloom_version == installed_version()
    assert measurement_doubts(hardware("h100")) == []  # the catalogue has no provenance


def test_a_disturbed_or_foreign_measurement_warns_with_the_fix(tmp_path):
    hw = replace(_measured(spread_max=0.31, other_load=0.6), rlloom_version="0.0.1")
    assert measurement_doubts(hw) == [
        "its microbenchmarks' repeats differed by up to 31% (limit 10%)",
        "other processes used 60% of the CPUs while it was measured (limit 25%)",
        f"rlloom 0.0.1 measured it, this is rlloom {installed_version()}"]
    path = tmp_path / "hw.json"
    hw.save(path)
    with pytest.warns(HardwareWarning, match="used 60% of the CPUs.*remeasure with "
                      "`rlloom bench hw` while nothing else runs"):
        load_hardware(path)


def test_pricing_with_a_doubtful_local_file_says_so(monkeypatch, tmp_path):
    """`rlloom plan --gpus 1xlocal` reads this machine's file (under RLLOOM_CACHE) and warns
    that it was measured under load."""
    from rlloom.cli import main
    from rlloom.perf.model.hardware import local_hardware_path
    monkeypatch.setenv("RLLOOM_CACHE", str(tmp_path))
    _measured(other_load=0.8).save(local_hardware_path())
    with pytest.warns(HardwareWarning, match="local.json: other processes used 80%"):
        main(["plan", "--model", "qwen2.5-0.5b", "--gpus", "1xlocal", "--prompts", "8",
              "--top", "1"])
