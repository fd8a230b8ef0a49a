"""rlloom from Python: a fresh process trains with a callable reward, an in-memory dataset and
a callback that stops the run, and gets the run's result back."""
import json
import subprocess
import sys

import pytest

import rlloom
from rlloom.cli import main
from rlloom.config import ConfigError, load_config

SCRIPT = """
import json, sys
import rlloom

def brevity(prompts, completions, completion_ids, **columns):
    return [1.0 / (1 + len(ids)) for ids in completion_ids]

rows = [{"prompt": f"Q:{a}+{b}=", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 9)]
steps = []

def stop_after_two(row):
    steps.append(row["step"])
    return row["step"] < 2

overrides = dict(arg.split("=", 1) for arg in sys.argv[2:])
result = rlloom.train(overrides={**overrides, "train.steps": 5, "run_dir": sys.argv[1]},
                      reward_funcs=[brevity], train_dataset=rows, eval_dataset=rows[:16],
                      callbacks=[stop_after_two])
print(json.dumps({"steps": steps, "rows": [r["step"] for r in result.metrics],
                  "brevity": [r["reward/brevity"] for r in result.metrics],
                  "before": result.eval_before, "after": result.eval_after,
                  "final": str(result.final_model), "run_dir": str(result.run_dir)}))
"""


def test_train_from_a_fresh_process_with_a_callable_reward_and_rows(tmp_path, tiny):
    run = tmp_path / "run"
    tiny = [a for a in tiny if not a.startswith(("data.difficulty", "data.train_size",
                                                  "data.eval_size", "train.steps"))]
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(run), *tiny],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["steps"] == [1, 2] and got["rows"] == [1, 2]
    assert all(0 < b <= 1 for b in got["brevity"])
    assert got["before"] is not None and got["after"] is not None
    assert got["run_dir"] == str(run) and (run / "final" / "config.json").is_file()
    assert "a callback stopped the run after step 2" in out.stdout
    # the run names only files (the function pickled by value): the CLI resumes it
    assert ".pkl:brevity" in (run / "config.yaml").read_text()
    main(["train", "--resume", str(run), "train.steps=3"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "reward/brevity" in rows[-1]


def test_prepare_takes_dict_overrides_and_a_run_config():
    run = rlloom.prepare(overrides={"train.steps": 7, "algo.kl_coef": 0.01})
    assert (run.cfg.train.steps, run.cfg.algo.kl_coef) == (7, 0.01)
    again = rlloom.prepare(run.cfg, ["train.lr=1e-5"])
    assert (again.cfg.train.steps, again.cfg.train.lr) == (7, 1e-5)
    assert load_config(None, ["train.steps=7"]).train.steps == 7


@pytest.mark.parametrize("dataset, message", [
    (42, "train must be a path, a list of dicts or a datasets.Dataset, not int"),
    ([], "train must hold at least one row"),
    ([{"prompt": object()}], "train: a row is not JSON data"),
])
def test_bad_datasets_are_named(dataset, message):
    with pytest.raises(ConfigError, match=message):
        rlloom.prepare(train_dataset=dataset)


def test_a_reward_without_a_name_is_refused():
    with pytest.raises(ConfigError, match="give a named function"):
        rlloom.prepare(reward_funcs=[lambda prompts, completions, **kw: [0.0]])
