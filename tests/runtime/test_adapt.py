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
        assert d["gain"] == pytest.approx(d["predicted_next_s"] / d["best_s"], rel=1e-12)
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


def test_a_switch_keeps_the_token_budget_its_plans_were_priced_with(tmp_path, tiny):
    """A run's steps are priced with its own `train.micro_batch_tokens` (1000 here), so every
    micro-batch size the search tries prices the same; the switched config once wrote the
    winner's size at the window's longest context instead (1 x 23 tokens, then 1 sequence a
    micro-batch as responses grew: 2.5x slower training on bench/adapt.py's run)."""
    from rlloom.runtime.executor.adapt import Adapter
    cfg = load_config(None, [*tiny, "train.micro_batch_tokens=1000", "plan.adapt.every=2",
                             "plan.adapt.hardware=h100", f"run_dir={tmp_path / 'run'}"])
    main(["sft", *tiny, "--out", str(tmp_path / "warm")])
    adapter = Adapter(cfg, tmp_path, tmp_path / "warm")
    for step in (1, 2):
        adapter.after({"step": step, "step_s": 0.5, "gen_s": 0.2, "assess_s": 0.05,
                       "train_s": 0.25, "prompt_len": 7.0, "response_lens": [5, 9, 16, 4] * 4})
    assert adapter.last.best.workload.micro_batch_tokens == 1000
    assert adapter.switched_config().train.micro_batch_tokens == 1000


def test_a_decision_prices_the_lengths_the_trend_gives_the_next_steps():
    """Steps 2-5 whose mean response length grows 10, 20, 30, 40 tokens (a line of slope 10):
    with a decision every 4 steps the next stretch's middle is step 7, mean 60, so every
    length is priced x60/25; the run's max_new_tokens caps each; a finished run (`ahead` 0)
    keeps its lengths."""
    from rlloom.perf.model.workload import Lengths, Workload
    from rlloom.perf.validation.advice import projected_lengths
    steps = [(s, Workload(response=Lengths.empirical([m - 5, m + 5])), {})
             for s, m in ((2, 10), (3, 20), (4, 30), (5, 40))]
    grown = projected_lengths(steps, ahead=4, cap=None)
    assert statistics.mean(grown) == pytest.approx(60)
    assert grown[:2] == pytest.approx([5 * 60 / 25, 15 * 60 / 25])
    assert max(projected_lengths(steps, ahead=4, cap=50)) == 50
    assert projected_lengths(steps, ahead=0, cap=None) == [5, 15, 15, 25, 25, 35, 35, 45]
