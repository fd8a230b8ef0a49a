import json
from pathlib import Path

import pytest

from rlloom.config import dump_config, load_config
from rlloom.rollout import engine


@pytest.fixture
def engine_counts(monkeypatch):
    """What the engine runs, counted as it runs: decode steps, live rows and key positions
    read summed over them, prefill forwards, and the tokens of each extend forward."""
    seen = {"steps": 0, "live": 0, "width": 0, "prefills": 0, "extends": []}
    decode, prefill, extend = engine._Run._decode_step, engine._Run._prefill, engine._Run._extend

    def counted_decode(run):
        seen["steps"] += 1
        seen["live"] += run.live
        seen["width"] += run.width  # key positions the step's attention reads
        decode(run)

    def counted_prefill(run, groups):
        seen["prefills"] += 1
        prefill(run, groups)

    def counted_extend(run, slot, tokens):
        seen["extends"].append(len(tokens))
        return extend(run, slot, tokens)
    monkeypatch.setattr(engine._Run, "_decode_step", counted_decode)
    monkeypatch.setattr(engine._Run, "_prefill", counted_prefill)
    monkeypatch.setattr(engine._Run, "_extend", counted_extend)
    return seen


@pytest.fixture
def fake_run(tmp_path):
    """A finished run's directory written by hand: a 2-layer qwen3 policy, GRPO with K=2, 2
    epochs of 2 mini-batches and a KL term, and two steps of the given response lengths, each
    stage measured at 1 s and the step at 3.25 s, named `name` under tmp_path."""
    def make(lengths: list[int], name: str = "run") -> Path:
        cfg = load_config(None, ["model.layers=2", "algo.epochs=2", "algo.minibatches=2",
                                 "rollout.n_samples=2", "algo.kl_coef=0.001"])
        run = tmp_path / name
        (run / "final").mkdir(parents=True)
        (run / "config.yaml").write_text(dump_config(cfg))
        (run / "final" / "config.json").write_text(json.dumps({
            "model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "vocab_size": 40}))
        rows = [{"step": s, "prompt_len": 7.0, "response_lens": lengths, "gen_s": 1.0,
                 "assess_s": 1.0, "train_s": 1.0, "step_s": 3.25} for s in (1, 2)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return run
    return make
