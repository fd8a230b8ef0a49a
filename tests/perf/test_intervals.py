"""Intervals around a priced step time: the hardware file's measured spread and calibration
residual widen it in quadrature; sampled response lengths spread it only where the steps'
longest rollouts differ; `rlloom plan` shows each plan's range and which plans it cannot tell
from the first."""
import json
from dataclasses import replace

import pytest

from rlloom.cli import main
from rlloom.perf.model.compose import price, role_models
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.interval import Interval, hardware_error, step_interval
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout, Plan

SHAPE = model_shape("qwen2.5-0.5b")
MODELS = role_models(SHAPE, ("actor", "reference"))
PLAN = Plan(layouts={"actor": Layout(dp=8)})


def test_the_hardware_error_is_spread_and_residual_in_quadrature():
    """spread 3% and residual 4%: sqrt(0.03^2 + 0.04^2) = 5%; a catalogue entry has none."""
    hw = replace(hardware("h100"), extra={"spread_max": 0.03, "calibration_error": 0.04})
    assert hardware_error(hw) == pytest.approx(0.05)
    assert hardware_error(hardware("h100")) == 0.0


def test_fixed_lengths_give_the_hardware_error_alone():
    """Fixed lengths draw nothing: the step's price +-5% exactly."""
    wl = Workload(64, 8, 256, Lengths("fixed", 512))
    hw = replace(hardware("h100"), extra={"spread_max": 0.03, "calibration_error": 0.04})
    mid = price(PLAN, MODELS, wl, hw).step_s
    iv = step_interval(PLAN, MODELS, wl, hw)
    assert (iv.low, iv.mid, iv.high) == pytest.approx((0.95 * mid, mid, 1.05 * mid))
    assert iv.half_width == pytest.approx(0.05)
    assert step_interval(PLAN, MODELS, wl, hardware("h100")) == Interval(mid, mid, mid)


def test_sampled_lengths_spread_only_an_uncapped_tail():
    """Capped at its p99, every step's 512 rollouts reach the cap (the 1% truncated there):
    the longest, which bounds generation, never varies, and the step moves by the other
    lengths' mean alone (0.17%). With the cap 8x higher the longest rollout differs step to
    step, and so does the step."""
    capped = Workload(64, 8, 256, Lengths("lognormal", 512, 2048))
    free = replace(capped, response=Lengths("lognormal", 512, 2048, cap=16384))
    hw = hardware("h100")
    iv = step_interval(PLAN, MODELS, capped, hw)
    assert iv.high / iv.low - 1 < 0.01
    iv = step_interval(PLAN, MODELS, free, hw)
    assert iv.low < iv.mid < iv.high and iv.high / iv.low > 1.1


def test_overlap_by_hand():
    a, b, c = Interval(1.0, 1.1, 1.2), Interval(1.15, 1.3, 1.4), Interval(1.25, 1.3, 1.35)
    assert a.overlaps(b) and b.overlaps(a) and b.overlaps(c)
    assert not a.overlaps(c) and not c.overlaps(a)


def test_plan_shows_each_range_and_the_ties(capsys):
    """Every ranked row carries its range around its step time, in the table and the JSON;
    rows whose range meets the first's are marked as not distinguishable from it."""
    args = ["plan", "--model", "qwen2.5-0.5b", "--gpus", "8xH100", "--prompts", "64",
            "--p50", "512", "--p99", "2048", "--top", "5"]
    main([*args, "--json"])
    rows = json.loads(capsys.readouterr().out)["ranked"]
    assert len(rows) == 5
    for row in rows:
        low, high = row["step_interval_s"]
        assert low <= row["step_s"] <= high
    main(args)
    out = capsys.readouterr().out
    assert "range s" in out
    first = rows[0]["step_interval_s"]
    ties = [r for r in rows[1:] if r["step_interval_s"][0] <= first[1]
            and first[0] <= r["step_interval_s"][1]]
    assert out.count(" ~") == len(ties)
    assert ("not distinguishable from it" in out) == bool(ties)
