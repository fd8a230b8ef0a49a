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


def rows_trained_with(tmp_path, tiny, source, name, *overrides):
    """The metrics rows of two steps rewarded by the function `name` defined in `source`."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(source)
    run = tmp_path / "run"
    main(["train", *tiny, f"reward.functions=[{rewards}:{name}]", "train.steps=2", *overrides,
          f"run_dir={run}"])
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_evaluation_scores_every_reward_term_and_pass_at_k(tmp_path, tiny):
    row = rows_trained_with(tmp_path, tiny, "def short(prompts, completions, **kw):\n"
                            "    return [float(len(c) < 8) for c in completions]\n", "short",
                            "eval.n_samples=4", "eval.temperature=1.0")[-1]
    assert {"eval/correct", "eval/format", "eval/short", "eval/reward", "eval/pass@1",
            "eval/pass@2", "eval/pass@4", "eval/mean@4"} <= set(row)
    assert row["eval/pass@1"] == pytest.approx(row["eval_accuracy"])
    assert row["eval/mean@4"] == pytest.approx(row["eval_accuracy"])
    assert row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1
    assert row["eval/reward"] == pytest.approx(row["eval/short"])  # the function weighs 1


def test_rlloom_eval_writes_a_report_for_any_checkpoint(tmp_path, tiny, capsys):
    """A score term that gives rows 1 and 4 of 6 full marks on every sample: mean@4, pass@1
    and pass@4 are all 2/6 by hand, and the verifier's accuracy is reported beside it."""
    run = tmp_path / "run"
    main(["train", *tiny, "train.steps=1", f"run_dir={run}"])
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q:{a}+{a}=", "answer": str(2 * a),
                                        "easy": a in (1, 4)}) + "\n" for a in range(1, 7)))
    rewards = tmp_path / "marks.py"
    rewards.write_text("def easy(prompts, completions, easy, **kw):\n"
                       "    return [float(e) for e in easy]\n")
    out = tmp_path / "report.json"
    main(["eval", str(run / "final"), f"data.eval_file={rows}", "eval.n_samples=4",
          "eval.temperature=1.0", "eval.max_new_tokens=16", f"reward.functions=[{rewards}:easy]",
          "eval.score=easy", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["problems"] == 6 and report["n_samples"] == 4
    assert report["score_name"].startswith("sampled (4 per problem) eval/easy (eval.score")
    for key in ("score", "eval/easy", "eval/mean@4", "eval/pass@1", "eval/pass@2",
                "eval/pass@4"):
        assert report[key] == pytest.approx(2 / 6), key
    assert {"eval_accuracy", "eval/correct"} <= set(report)
    assert f"report written to {out}" in capsys.readouterr().out
    # beside it, each problem: its responses with their terms, passes and pass@k by hand
    per_problem = [json.loads(line) for line in
                   (tmp_path / "report.samples.jsonl").read_text().splitlines()]
    assert [p["prompt"] for p in per_problem] == [f"Q:{a}+{a}=" for a in range(1, 7)]
    assert [p["passed"] for p in per_problem] == [4, 0, 0, 4, 0, 0]
    assert [p["pass@2"] for p in per_problem] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    first = per_problem[0]["responses"]
    assert len(first) == 4 and all(r["easy"] == 1.0 and isinstance(r["completion"], str)
                                   for r in first)
    assert {"correct", "format", "reward"} <= set(first[0])


def test_a_task_without_verifier_scores_with_the_first_function_and_says_so(tmp_path, tiny,
                                                                           capsys):
    """data.task=none: rows need only a prompt, no accuracy is logged anywhere, and the run
    names the term it treats as its score."""
    import rlloom
    from rlloom.runtime.default_model import ensure_default_model

    model = ensure_default_model(load_config(None, tiny))

    def short(prompts, completions, completion_ids, **kw):
        return [float(len(ids) <= 8) for ids in completion_ids]

    def polite(prompts, completions, **kw):
        return [0.5] * len(completions)

    rows = [{"prompt": f"Q:{a}+1="} for a in range(40)]
    result = rlloom.train(overrides=[*tiny, "data.task=none", "train.steps=2",
                                     f"model.path={model}",
                                     f"run_dir={tmp_path / 'run'}"],
                          reward_funcs=[short, polite], train_dataset=rows[:32],
                          eval_dataset=rows[32:])
    out = capsys.readouterr().out
    assert ("held-out greedy eval/short (the first of reward.functions; eval.score chooses "
            "another) before RL:") in out
    assert not any("accuracy" in k for r in result.metrics for k in r)
    assert result.metrics[-1]["eval/polite"] == pytest.approx(0.5)
    assert result.eval_after == pytest.approx(result.metrics[-1]["eval/short"])


@pytest.mark.parametrize("overrides, message", [
    (["data.task=none", "data.prompt_file=ROWS", "model.path=ROWS"],
     "nothing rewards a response; set reward.functions"),
    (["data.task=none"], "data.task=none has no built-in problems or model; set "
                         r"data.prompt_file \(or for rlloom eval data.eval_file\) and model.path"),
    (["eval.score=model"], "eval.score='model' is not a term the evaluation scores"),
])
def test_unscored_tasks_are_refused(tmp_path, overrides, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ConfigError, match=message):
        load_config(None, [o.replace("ROWS", str(rows)) for o in overrides])


def test_a_row_without_the_verifiers_field_names_task_none(tmp_path):
    from rlloom.data.prompts import read_prompt_file
    from rlloom.data.row_files import DataError
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DataError, match="missing field 'answer' required by task 'arith'.*"
                                        "set data.task=none"):
        read_prompt_file(rows, "arith")


def test_a_user_function_is_the_score_by_eval_score_and_never_the_accuracy(tmp_path, tiny):
    rows = rows_trained_with(tmp_path, tiny, "def starts_a(prompts, completions, **kw):\n"
                             "    return [1.0 if c.startswith('A') else 0.0 for c in "
                             "completions]\n", "starts_a", "eval.score=starts_a")
    for row in rows:  # accuracy stays the verifier's
        assert row["accuracy"] == pytest.approx(row["reward/correct"])
    assert rows[-1]["eval_accuracy"] == pytest.approx(rows[-1]["eval/correct"])
    assert "eval/starts_a" in rows[-1]