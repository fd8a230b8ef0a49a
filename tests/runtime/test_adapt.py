"""plan.adapt: every N steps the run re-prices its plan against the best on its devices with
the cost model calibrated on its recent steps, and records the decision (dry: no switch;
test_ray_adapt.py switches)."""
import json
import statistics

import pytest

from rlloom.cli import main
from rlloom.config import ConfigError, load_config


def test_every_second_step_the_plan_is_re_priced_and_the_decision_recorded(tmp_path, tiny,
                                                                          capsys):
    run = tmp_path / "run"
    main(["train", *tiny, "train.steps=4", "plan.adapt.every=2", "plan.adapt.hardware=h100",
          f"run_dir={run}"])
    out = capsys.readouterr().out
    decisions = [json.loads(x) for x in (run / "adapt.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                      .splitlines())}
    # step 1 is the warm-up: the windows are steps 2-2, then 2-4
    assert [(d["step"], d["steps"]) for d in decisions] == [(2, [2, 2]), (4, [2, 4])]
    for d in decisions:
        window = [rows[s]["step_s"] for s in range(d["steps"][0], d["step"] + 1)]
        assert d["measured_s"] == pytest.approx(statistics.median(window), rel=1e-12)
        assert d["gain"] == pytest.approx(d["predicted_s"] / d["best_s"], rel=1e-12)
        assert d["gain"] >= 1 - 1e-9  # the run's own plan is among those searched
        assert d["better"] == (d["gain"] >= 1.15) and d["dry"] is True
        assert rows[d["step"]]["adapt_gain"] == pytest.approx(d["gain"], rel=1e-12)
        assert f"adapt at step {d['step']} (steps {d['steps'][0]}-{d['steps'][1]})" in out
    assert "adapt_gain" not in rows[1] and "adapt_gain" not in rows[3]
    marks = [e for e in json.loads((run / "trace.json").read_text())["traceEvents"]
             if e["name"] == "adapt"]
    assert [m["args"]["step"] for m in marks] == [2, 4]


def test_an_offline_algorithm_has_no_stages_to_re_price():
    with pytest.raises(ConfigError, match="trains offline"):
        load_config(None, ["plan.adapt.every=2", "algo=dpo", "data.preference_file=x.jsonl"])


def test_switching_in_one_process_is_refused_before_the_run(tmp_path, tiny, capsys):
    """A switch rebuilds Ray groups; one process has none to rebuild."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        main(["train", *tiny, "plan.adapt.every=2", "plan.adapt.dry=false",
              "plan.adapt.hardware=h100", f"run_dir={run}"])
    assert "switches plans by rebuilding Ray groups" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists()


def test_an_unknown_hardware_file_stops_the_run_before_it_starts(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        main(["train", *tiny, "plan.adapt.every=2", "plan.adapt.hardware=nowhere",
              f"run_dir={run}"])
    assert stop.value.code == 2
    assert "plan.adapt.hardware='nowhere': unknown hardware" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists()


def test_without_this_machine_measured_the_run_is_told_to_measure_it(tmp_path, tiny, capsys):
    """The default hardware file is this machine's (`rlloom bench hw`); the test cache has
    none."""
    with pytest.raises(SystemExit):
        main(["train", *tiny, "plan.adapt.every=2", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "plan.adapt cannot run here" in err and "run `rlloom bench hw`" in err
    assert not (tmp_path / "run").exists()
