"""Held-out evaluation scores with the run's own reward terms, greedy or sampled with
pass@k (the unbiased estimator, by hand)."""
import json

import pytest

from rlloom.cli import main
from rlloom.config import ConfigError, load_config
from rlloom.runtime.stages.evaluate import ks, pass_at_k


@pytest.mark.parametrize("c, k, expected", [
    (0, 1, 0.0), (1, 1, 0.25), (2, 1, 0.5), (4, 1, 1.0),
    (1, 2, 1 - 3 / 6), (2, 2, 1 - 1 / 6), (0, 2, 0.0),      # 1 - C(4-c, 2) / C(4, 2)
    (1, 4, 1.0), (0, 4, 0.0), (3, 3, 1.0),
])
def test_pass_at_k_by_hand_for_four_samples(c, k, expected):
    assert pass_at_k(4, c, k) == pytest.approx(expected)


def test_reported_ks():
    assert (ks(1), ks(6), ks(8)) == ([1], [1, 2, 4, 6], [1, 2, 4, 8])


def test_sampled_evaluation_needs_a_temperature():
    with pytest.raises(ConfigError, match="eval.n_samples=4 greedy responses would all be the "
                                          "same; set eval.temperature"):
        load_config(None, ["eval.n_samples=4"])


def test_evaluation_scores_every_reward_term_and_pass_at_k(tmp_path, tiny):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def short(prompts, completions, **kw):\n"
                       "    return [float(len(c) < 8) for c in completions]\n")
    run = tmp_path / "run"
    main(["train", *tiny, f"reward.functions=[{rewards}:short]", "eval.n_samples=4",
          "eval.temperature=1.0", "train.steps=2", f"run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1]
    assert {"eval/correct", "eval/format", "eval/short", "eval/reward", "eval/pass@1",
            "eval/pass@2", "eval/pass@4", "eval/mean@4"} <= set(row)
    assert row["eval/pass@1"] == pytest.approx(row["eval_accuracy"])
    assert row["eval/mean@4"] == pytest.approx(row["eval_accuracy"])
    assert row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1
    assert row["eval/reward"] == pytest.approx(row["eval/short"])  # the function weighs 1


def test_rlloom_eval_writes_a_report_for_any_checkpoint(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    main(["train", *tiny, "train.steps=1", f"run_dir={run}"])
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q:{a}+{a}=", "answer": str(2 * a)}) + "\n"
                            for a in range(1, 7)))
    out = tmp_path / "report.json"
    main(["eval", str(run / "final"), f"data.eval_file={rows}", "eval.n_samples=4",
          "eval.temperature=1.0", "eval.max_new_tokens=16", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["problems"] == 6 and report["n_samples"] == 4
    assert {"accuracy", "eval/correct", "eval/pass@1", "eval/pass@4", "eval/mean@4"} <= set(report)
    assert report["eval/pass@1"] == pytest.approx(report["accuracy"])
    assert f"report written to {out}" in capsys.readouterr().out


def test_a_reward_function_named_correct_replaces_the_verifier_everywhere(tmp_path, tiny):
    rewards = tmp_path / "mine.py"
    rewards.write_text("def correct(prompts, completions, **kw):\n"
                       "    return [1.0 if c.startswith('A') else 0.0 for c in completions]\n")
    run = tmp_path / "run"
    main(["train", *tiny, f"reward.functions=[{rewards}:correct]", "train.steps=2",
          f"run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # accuracy is the share of full marks by the user's `correct`
        assert row["accuracy"] == pytest.approx(row["reward/correct"])
    assert rows[-1]["eval_accuracy"] == pytest.approx(rows[-1]["eval/correct"])
