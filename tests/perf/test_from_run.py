"""`rlloom plan --from-run RUN_DIR`: a finished run's workload, devices and calibrated
hardware, its own plan priced next to the best one on the same devices."""
import re

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.perf.model.hardware import hardware


def test_a_run_is_priced_against_the_best_plan_on_its_devices(fake_run, tmp_path, capsys):
    run = fake_run([4, 8, 8, 16])  # 2 prompts x 2 samples a step
    hw_file, plan_file = tmp_path / "h100.json", tmp_path / "best.yaml"
    hardware("h100").save(hw_file)
    main(["plan", "--from-run", str(run), "--hardware", str(hw_file), "--top", "3",
          "--write-plan", str(plan_file)])
    out = capsys.readouterr().out
    # step 1 is the warm-up: one step, its lengths sorted 4 8 8 16 -> p50 8, p99 16
    assert (f"from {run}: 1 steps after the warm-up, 2 prompts x 2 samples, response lengths "
            "p50 8 p99 16 (max 16), 1 devices") in out
    assert "calibrated on the run: compute_eff" in out
    assert "measured 3.25 s per step (median step_s)" in out
    own = float(re.search(r"measured 3.25 s per step \(median step_s\), predicted ([\d.e+-]+) s",
                          out).group(1))
    best, was, gain = re.search(r"would have taken ([\d.e+-]+) s per step instead of "
                                r"([\d.e+-]+) .*: ([\d.]+)x", out).groups()
    assert float(was) == own
    # the run's own plan is among those searched, so the best is never slower
    assert float(best) <= own and float(gain) >= 1.0
    assert abs(float(gain) - own / float(best)) < 0.01 * float(gain)
    assert len(re.findall(r"^\s+[\d.e+-]+\s+[\d.]+x  ", out, flags=re.M)) == 3
    cfg = load_config(str(plan_file), [])
    assert cfg.algo.name == "grpo" and "actor" in cfg.plan.layouts


def test_a_directory_that_is_not_a_run_is_named(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    hardware("h100").save(tmp_path / "h100.json")
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--from-run", str(tmp_path / "empty"), "--hardware",
              str(tmp_path / "h100.json")])
    assert stop.value.code == 2
    assert f"{tmp_path / 'empty'}: no config.yaml" in capsys.readouterr().err
