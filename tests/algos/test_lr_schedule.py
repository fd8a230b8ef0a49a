"""Learning-rate schedules: golden values by hand, and a run that logs them and resumes on
them."""
import json
import math

import pytest

from rlloom.algos.lr_schedule import lr_factor
from rlloom.config import load_config
from rlloom.runtime.executor.launch import train


def test_warmup_then_decay_by_hand():
    # 10 steps, 2 of warm-up: 1/2, 1, then 8 decay steps from 1 at step 3, reaching
    # min_ratio one step after step 10 (transformers' schedules, whose step 0 is our step 1)
    assert [lr_factor(s, 10, "constant", 2) for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(3, 10, "linear", 2, 0.2) == 1.0
    assert lr_factor(6, 10, "linear", 2, 0.2) == pytest.approx(0.2 + 0.8 * (1 - 3 / 8))
    assert lr_factor(10, 10, "linear", 2, 0.2) == pytest.approx(0.2 + 0.8 / 8)  # not 0.2
    assert lr_factor(10, 10, "linear", 2) == pytest.approx(1 / 8)  # never a wasted 0
    assert lr_factor(6, 10, "cosine", 2) == pytest.approx(0.5 * (1 + math.cos(3 * math.pi / 8)))
    assert lr_factor(10, 10, "cosine", 2, 0.1) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(7 * math.pi / 8)))
    assert lr_factor(1, 10, "cosine") == 1.0


def test_linear_decay_matches_transformers():
    transformers = pytest.importorskip("transformers")
    import torch
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, 10)
    theirs = []
    for _ in range(10):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [lr_factor(s, 10, "linear") for s in range(1, 11)] == pytest.approx(theirs)


def test_a_run_logs_its_schedule_and_resumes_on_it(tmp_path, tiny):
    args = [*tiny, "train.steps=4", "train.lr=1e-3", "train.lr_schedule=linear",
            "train.warmup_steps=2", "train.min_lr_ratio=0.5"]

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
                for line in (run / "metrics.jsonl").read_text().splitlines()]
    whole = tmp_path / "whole"
    train(load_config(None, [*args, f"run_dir={whole}"]))
    assert [r["lr"] for r in rows(whole)] == pytest.approx([5e-4, 1e-3, 1e-3, 7.5e-4])
    cut = tmp_path / "cut"
    train(load_config(None, [*args, "train.steps=2", f"run_dir={cut}"]))
    train(load_config(cut / "config.yaml", ["train.steps=4"]), resume_dir=cut)
    assert rows(cut) == rows(whole)
