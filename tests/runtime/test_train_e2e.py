"""Short end-to-end runs of `rlloom train` on a tiny built-in model."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import torch

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.models.hf_io import load_model
from rlloom.runtime.executor.launch import local_loop, train
from rlloom.runtime.stages.batch import decode_responses
from rlloom.runtime.stages.generation import sample_groups

TIMING = {"gen_s", "assess_s", "train_s", "step_s"}


def test_short_run_writes_everything(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    main(["train", *tiny, f"run_dir={run}"])
    out = capsys.readouterr().out
    assert "held-out greedy accuracy: before RL" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ["reward", "accuracy", "kl", "clip_frac", "entropy", "response_len",
                    "gen_s", "assess_s", "train_s"]:
            assert math.isfinite(r[key]), key
    assert "eval_accuracy" in rows[1] and "eval_accuracy" in rows[2]
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {"generation", "assessment", "training", "eval"} <= {e["name"] for e in trace}
    assert (run / "summary.png").stat().st_size > 10_000
    assert (run / "config.yaml").is_file()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000003"]
    final = load_model(run / "final")                 # checkpoint round trip
    state = torch.load(run / "checkpoints/step_000003/state.pt", weights_only=False)
    for name, tensor in final.state_dict().items():
        assert torch.equal(tensor, state["policy"][name]), name


def _rlloom(*args, env=None):
    return subprocess.Popen([sys.executable, "-c", "from rlloom.cli import main; main()", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _rows(run):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_killed_and_resumed_run_matches_uninterrupted(tmp_path, tiny):
    args = [*tiny, "train.steps=5", "eval.every=2"]
    env = dict(os.environ)
    whole = tmp_path / "whole"
    assert _rlloom("train", *args, f"run_dir={whole}", env=env).wait() == 0

    killed = tmp_path / "killed"
    proc = _rlloom("train", *args, f"run_dir={killed}", env=env)
    ckpt = killed / "checkpoints" / "step_000002"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ckpt.exists(), "the run should have reached its step-2 checkpoint before the kill"
    assert len(_rows(killed)) < 5

    assert _rlloom("train", "--resume", str(killed), env=env).wait() == 0
    assert _rows(killed) == _rows(whole)


def test_explicit_cpu_device_runs_and_resumes(tmp_path, tiny):
    """train.device=cpu end to end: every model on the CPU, a checkpoint resumed, and the
    trained weights exported."""
    run = tmp_path / "run"
    cfg = load_config(None, [*tiny, "train.device=cpu", "train.steps=1", f"run_dir={run}"])
    train(cfg)
    cfg = load_config(run / "config.yaml", ["train.steps=2"])
    assert cfg.train.device == "cpu"
    loop = local_loop(cfg, run)
    loop.ex.start()
    assert loop.restore(from_checkpoint=True) and loop.step == 1
    worker = loop.ex.worker
    assert worker.device == torch.device("cpu")
    models = [worker.training.policy, worker.assessment.reference]
    assert {p.device for m in models for p in m.parameters()} == {torch.device("cpu")}
    trained = worker.training.policy
    loop.run(resume=True)
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").open())] == [1, 2]
    trained = trained.state_dict()
    for name, tensor in load_model(run / "final").state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_rollout_stop_strings_and_min_p_reach_generation(tmp_path, tiny):
    """rollout.stop ends a response at its first stop string (kept, counted as finished);
    rollout.min_p=0.99 keeps only the most likely token (or near-ties of it), so a group's K
    samples mostly agree, where plain sampling makes nearly all of them differ."""
    def sampled(*overrides: str):
        cfg = load_config(None, [*tiny, *overrides, f"run_dir={tmp_path / 'r'}"])
        loop = local_loop(cfg, tmp_path / "r")
        loop.ex.start()
        g = loop.ex.worker.generation
        problems = g.stream.next(8)
        s = sample_groups(loop.ex.worker.training.policy, g.tokenizer, problems, cfg,
                          g.rewarder, g.sample_gen)
        loop.ex.stop()
        return s, decode_responses(g.tokenizer, s.rollout)

    s, texts = sampled("rollout.stop=['1']", "rollout.max_new_tokens=24")
    hits = [i for i, t in enumerate(texts) if "1" in t]
    assert len(hits) >= 4, texts       # the tiny arithmetic model writes digits
    for i in hits:
        assert texts[i].index("1") == len(texts[i]) - 1 and s.rollout.finished[i], texts[i]

    def distinct(min_p: str) -> int:
        s, texts = sampled(f"rollout.min_p={min_p}", "rollout.temperature=1.0")
        k = s.rollout.response_ids.shape[0] // 8
        return sum(len(set(texts[g * k:(g + 1) * k])) for g in range(8))

    assert distinct("0.99") <= 16 < 28 <= distinct("0.0")   # of 8 groups x K=4 samples
