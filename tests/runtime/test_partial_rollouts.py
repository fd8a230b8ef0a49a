"""Partial rollouts through the step loop: carried responses mix weight versions (measured as
token staleness and corrected by the decoupled loss), a run resumes with its pool, and a
generation group of two replicas decodes what one process decodes. (A chunk as long as the
response limit decoding what plain generation decodes: tests/rollout/test_partial.py.)"""
import json

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.runtime.executor.launch import train

TIMING = {"gen_s", "assess_s", "train_s", "step_s", "sync_s", "reshard_s"}


def _rows(run, drop=()):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING | set(drop)}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, name, args):
    run = tmp_path / name
    train(load_config(None, [*args, f"run_dir={run}"]))
    return run


def test_carried_tokens_are_stale_corrected_and_survive_a_resume(tmp_path, tiny):
    args = [*tiny, "rollout.partial_tokens=4", "train.steps=4", "eval.every=2",
            "algo.overlong=penalty"]
    whole = _run(tmp_path, "whole", args)
    rows = _rows(whole)
    # 16 tokens in chunks of 4: a response finishing at step s holds tokens of up to 3 older
    # versions; the first step has only version 0
    assert rows[0]["token_staleness"] == 0.0
    assert all(0 < r["token_staleness"] <= 3 for r in rows[1:])
    assert all(r["staleness"] == 0 for r in rows)  # every call used the newest weights
    assert all(r["behaviour_kl"] != 0 for r in rows[1:])  # the decoupled correction ran
    assert all(len(r["response_lens"]) == 16 for r in rows)  # B x K whole groups each step

    cut = _run(tmp_path, "cut", [*args, "train.steps=2"])
    train(load_config(cut / "config.yaml", ["train.steps=4"]), resume_dir=cut)
    assert _rows(cut) == rows


ray = pytest.importorskip("ray")


@pytest.mark.usefixtures("ray_cluster")
def test_two_generation_replicas_decode_what_one_process_decodes(tmp_path, tiny):
    """Nearly greedy (temperature 1e-6), so what a row samples does not depend on the
    replica's generator: the pool's rows split over two replicas and gathered give the one
    process's batches."""
    args = [*tiny, "rollout.partial_tokens=4", "rollout.temperature=1e-6", "model.dtype=float64",
            "algo.overlong=penalty", "train.steps=3"]
    single = _run(tmp_path, "single", args)
    ray_run = tmp_path / "ray"
    main(["train", *args, "plan.placement=disaggregated", "plan.layouts.generation.dp=2",
          f"run_dir={ray_run}", "--worker-timeout", "300"])
    got, expected = _rows(ray_run, ["sync_bytes"]), _rows(single, ["sync_bytes"])
    assert [r["response_lens"] for r in got] == [r["response_lens"] for r in expected]
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (a["step"], key)
    assert _rows(single)[-1]["token_staleness"] > 0
