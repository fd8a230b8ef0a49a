"""`rlloom bench hw` on this machine, then `rlloom perf validate` and `rlloom perf calibrate`
on a real run priced with what it measured."""
import warnings

import pytest

from rlloom.perf.model.hardware import (
    HardwareWarning,
    installed_version,
    load_hardware,
    measurement_doubts,
)


def test_bench_hw_then_validate_a_real_run(tmp_path, tiny, capsys):
    """`rlloom bench hw --quick` measures this machine (every microbenchmark of the full
    measurement, timed a tenth as long: the file says so); `rlloom perf validate` prices a
    real run's steps with it and prints predicted vs measured for every stage; `rlloom perf
    calibrate` saves the efficiencies that fit it (one factor on the file's 1.0 and 1.0) and
    the driver's round trip per stage call and rank from the run's trace."""
    from rlloom.cli import main
    hw_file, run = tmp_path / "hw.json", tmp_path / "run"
    main(["bench", "hw", "--quick", "--out", str(hw_file)])
    out = capsys.readouterr().out
    assert "of the CPUs" in out  # how busy others kept the machine
    assert "it was measured with --quick" in out
    with warnings.catch_warnings():  # a suite running beside it may well disturb it
        warnings.simplefilter("ignore", HardwareWarning)
        hw = load_hardware(hw_file)
    assert hw.rlloom_version == installed_version() and hw.extra["measured_at"] > 1.7e9
    assert hw.extra["spread_max"] >= 0 and 0 <= hw.extra["other_load"] <= 1
    assert hw.peak_flops["fp32"] > 1e8 and hw.mem_bw > 1e8 and 0 < hw.launch_s < 1e-3
    assert 0 <= hw.sharded_launch_s < 1e-2 and 0 <= hw.wrapped_pass_s < 1e-1
    assert 0 < hw.attn_elem_s < 1e-6  # CPU attention: a few ns per score element
    # the runtime's stages cost more host time per operator than a plain forward (2-3x and
    # 1.5-2x measured), half of it a floor, unless measured beside other work (it says so)
    assert hw.train_launch_s < 1e-3 and hw.assess_launch_s < 1e-3
    if not measurement_doubts(hw):
        assert 0.5 * hw.launch_s < hw.train_launch_s < hw.assess_launch_s
    main(["train", *tiny, f"run_dir={run}"])
    capsys.readouterr()
    main(["perf", "validate", str(run), "--hardware", str(hw_file)])
    out = capsys.readouterr().out
    for stage in ("generation", "assessment", "training"):
        assert f"run              {stage}" in out
    # 3 stages of one run, each its mean over steps 2 and 3; per step: 2 x 3 measurements
    assert "median per-stage |error| over 3 run stages" in out
    assert "median over 6 stage measurements" in out
    assert "measured within the predicted range (+-" in out and " of 3 run stages" in out
    fitted_file = tmp_path / "fitted.json"
    main(["perf", "calibrate", str(run), "--hardware", str(hw_file), "--out", str(fitted_file)])
    out = capsys.readouterr().out
    assert "calibrated on run: compute x" in out and "assessment dispatch x" in out
    with warnings.catch_warnings():  # doubtful as hw_file is: its provenance carries over
        warnings.simplefilter("ignore", HardwareWarning)
        fitted = load_hardware(fitted_file)
    assert fitted.extra["quick"] == 1.0
    assert fitted.peak_flops == hw.peak_flops and fitted.compute_eff == fitted.mem_eff
    assert 0 < fitted.call_s < 0.05 and f"{fitted.call_s * 1e3:.1f} ms per stage call" in out
    # above 1 the run outran a file measured under load (a suite beside it): the report says so
    assert 0.05 <= fitted.compute_eff <= 1.0 or "measured while other work ran" in out
    # what the fit leaves unexplained is kept: it widens every interval priced with the file
    after = float(out.split(" -> ")[1].split("%")[0]) / 100
    assert fitted.extra["calibration_error"] == pytest.approx(after, abs=1e-3)
