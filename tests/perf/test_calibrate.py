"""`rlloom perf calibrate` and how `rlloom perf validate` scores a stage: the fit finds the
efficiencies that made a run's times, and a stage's error is that of its mean over steps."""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlloom.perf.model.hardware import Hardware, hardware
from rlloom.perf.validation.validate import validate_run


def _measured_as(truth: Hardware, run: Path) -> None:
    """Rewrite the run's measured stage seconds as `truth`'s predictions."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    made = {(p.step, p.stage): p.predicted_s for p in validate_run(run, truth)}
    for r in rows[1:]:
        r.update(gen_s=made[r["step"], "generation"], assess_s=made[r["step"], "assessment"],
                 train_s=made[r["step"], "training"])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_calibrate_recovers_the_factors_that_made_the_times(fake_run):
    """Measured times written as the model's own predictions on a file at compute_eff 0.5 and
    mem_eff 0.8 scaled by 0.5 (0.25, 0.4), attn_eff 0.35 and assessment's host time per
    operator 1.5 us for the file's 1 us (a CPU: dispatch adds to the work), over four steps of
    different lengths: calibrating the unscaled file finds them (three stages, three terms),
    keeping the file's 5:8 ratio, and says which of them the noise would leave open."""
    from rlloom.perf.validation.validate import CALIBRATE_POINTS, WIDE, calibrate
    base = replace(hardware("h100"), peak_flops={"fp32": 2e9, "bf16": 2e9}, mem_bw=2e8,
                   launch_s=1e-6, compute_eff=0.5, mem_eff=0.8, dispatch_overlap=0.0)
    run = fake_run([5, 5, 5, 5])
    rows = [{"step": step, "prompt_len": 7.0, "response_lens": lengths, "gen_s": 1.0,
             "assess_s": 1.0, "train_s": 1.0}
            for step, lengths in ((1, [5, 5, 5, 5]), (2, [3, 9, 30, 60]), (3, [40, 40, 2, 7]),
                                  (4, [200, 150, 180, 120]), (5, [1, 2, 400, 3]))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _measured_as(replace(base, compute_eff=0.25, mem_eff=0.4, attn_eff=0.35,
                         assess_launch_s=1.5e-6), run)
    ticks = []
    fit = calibrate([run], base, tick=lambda: ticks.append(1))
    got = fit.hardware
    assert got.compute_eff == pytest.approx(0.25, rel=1e-3)
    assert got.mem_eff == pytest.approx(0.4, rel=1e-3)
    assert got.attn_eff == pytest.approx(0.35, rel=1e-3)
    assert got.assess_launch_s == pytest.approx(1.5e-6, rel=1e-3)
    assert fit.factors == pytest.approx({"compute": 2.0, "attention": 1 / 0.35,
                                         "assessment dispatch": 1.5}, rel=1e-3)
    # three stage means, three terms: no residual to estimate the noise from, so each
    # factor's error is the floor's (8% between identical runs) through the fit's slopes;
    # this model's assessment is nearly all compute, so 8% noise would hide its dispatch
    assert 0 < fit.spread["compute"] < fit.spread["attention"] < WIDE < fit.spread[
        "assessment dispatch"]
    assert len(ticks) == CALIBRATE_POINTS  # the progress bar ends full
    assert fit.after < 1e-4 < 0.1 < fit.before


def test_calibrate_says_when_the_runs_cannot_tell_the_attention(fake_run, tmp_path):
    """On a device whose memory is 500 times faster than its arithmetic, 5-token responses'
    KV reads cost nothing next to the rest: the attention's factor is left at 1 and reported as not
    determined. With
    memory as slow as the arithmetic and 400-token responses, the attention's cost shows and
    the fit finds it."""
    from rlloom.perf.validation.validate import calibration_report
    fast_memory = replace(hardware("h100"), peak_flops={"fp32": 2e9, "bf16": 2e9},
                          mem_bw=1e12, launch_s=1e-6, compute_eff=1.0, mem_eff=1.0)
    run = fake_run([5, 5, 5, 5])
    _measured_as(replace(fast_memory, compute_eff=0.5, mem_eff=0.5, attn_eff=0.3), run)
    report = calibration_report([run], fast_memory, tmp_path / "fit.json")
    assert "attention x1.00 (not determined)" in report
    assert "attention and assessment dispatch are not determined by these runs" in report
    slow_memory = replace(fast_memory, mem_bw=2e9)
    long = fake_run([400, 380, 390, 400], "long")
    _measured_as(replace(slow_memory, compute_eff=0.5, mem_eff=0.5, attn_eff=0.3), long)
    report = calibration_report([long], slow_memory, tmp_path / "fit.json")
    assert "attn_eff 0.30" in report and "attention x3.33 (+-" in report


def test_stage_error_is_of_the_stage_mean_over_steps():
    """Two steps of one stage measured 1.0 s and 3.0 s, predicted 2.0 s each: the steps are
    off by +100% and -33%, the stage's mean (4.0 s against 4.0 s) by nothing."""
    from rlloom.perf.validation.validate import StagePoint, stage_errors
    points = [StagePoint("r", 2, "training", 2.0, 1.0), StagePoint("r", 3, "training", 2.0, 3.0),
              StagePoint("r", 2, "generation", 1.5, 1.0)]
    assert stage_errors(points) == {("r", "training"): 0.0, ("r", "generation"): 0.5}


def test_validation_points_an_uncalibrated_file_to_calibrate(fake_run):
    from rlloom.perf.validation.validate import validation_report
    run = fake_run([5, 5, 5, 5])  # measured 1 s per stage, predicted ~1e-3 s
    raw = replace(hardware("h100"), compute_eff=1.0, mem_eff=1.0)
    assert "fit them with `rlloom perf calibrate`" in validation_report([run], raw)
    fitted = replace(raw, compute_eff=0.9)
    assert "perf calibrate" not in validation_report([run], fitted)


def test_validation_asks_for_a_new_bench_when_a_cpu_file_lacks_the_stage_costs(fake_run):
    """A CPU file (dispatch not overlapped) without the stages' host time per operator, as an
    older `rlloom bench hw` wrote it, is named; a GPU file, or a CPU file with both, is not."""
    from rlloom.perf.validation.validate import validation_report
    run = fake_run([5, 5, 5, 5])
    cpu = replace(hardware("h100"), dispatch_overlap=0.0, launch_s=4e-6)
    assert "run `rlloom bench hw` again" in validation_report([run], cpu)
    measured = replace(cpu, assess_launch_s=1e-5, train_launch_s=6e-6)
    assert "bench hw" not in validation_report([run], measured)
    assert "bench hw" not in validation_report([run], hardware("h100"))


def test_a_factors_uncertainty_reads_as_a_person_reads_it():
    """One standard error of a log factor: 0.1 is +-11% (e^0.1 - 1); past 0.5 (x1.65) the
    report says only that it is wide, and a huge one (3000, seen on a real run: e^3000
    overflows a float) or an infinite one (a direction the runs do not weigh) cannot crash it."""
    import math

    from rlloom.perf.validation.validate import uncertainty
    assert uncertainty(0.1) == "+-11%"
    assert uncertainty(0.6) == uncertainty(3000.0) == "+-over 65%"
    assert uncertainty(math.inf) == "not determined"
