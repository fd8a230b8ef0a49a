"""The worked example of docs/own-model.md (a TRL user's port) runs as written: its bash
block, in an empty directory, with this environment's `python` and `rlloom` first on PATH."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "own-model.md"


def worked_example(marker: str = "worked-example:", language: str = "bash") -> str:
    text = GUIDE.read_text()
    after = text.split(f"<!-- {marker}", 1)[1]
    return after.split(f"```{language}\n", 1)[1].split("\n```", 1)[0]


def test_the_worked_example_runs_as_written(tmp_path):
    pytest.importorskip("tensorboard")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "RLLOOM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(["bash", "-e", "-c", worked_example()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in
            (tmp_path / "runs/worked/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {"reward/exact", "reward/short", "lr"} <= set(rows[0])
    # warm-up over 2 steps, then cosine decay from the peak at step 3 (transformers'
    # convention: it would reach 0 one step after the last)
    assert [r["lr"] for r in rows] == pytest.approx([5e-5, 1e-4, 1e-4, 8.535534e-5, 5e-5,
                                                     1.464466e-5], rel=1e-5)
    assert list((tmp_path / "runs/worked/tensorboard").iterdir())
    # step 5 loaded final/ in transformers and printed the greedy reply's repr
    # (a reply holding a ' is repr'd in double quotes; the random model may write one)
    assert done.stdout.strip().splitlines()[-1].startswith(("'", '"'))
    # the score is the user's function (no verifier: no accuracy), and the warm start of
    # step 3 makes it more than 0
    said = "held-out greedy eval/exact (the first of reward.functions; eval.score chooses " \
           "another) before RL: "
    before = float(done.stdout.split(said, 1)[1].split()[0])
    assert 0 < before <= 1 and not any("accuracy" in k for r in rows for k in r)

    # the Python block, in the same directory: the same run through rlloom.train
    python = subprocess.run([sys.executable, "-c", worked_example("worked-example-python",
                                                                  "python")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert python.returncode == 0, python.stderr[-3000:]
    lines = python.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == \
        [f"step {i}" for i in range(1, 7)]
    assert lines[-2].startswith("held-out eval/exact: before RL ")
    assert lines[-1].startswith("pass@1 ") and lines[-1].endswith("model in runs/worked_py/final")
    pass1, pass4 = (float(w.strip(",;")) for w in lines[-1].split()[1:4:2])
    assert 0 <= pass1 <= pass4 <= 1
