"""Composite rewards in training: the code task through the sandbox, and a reward model."""
import json
from pathlib import Path

import pytest
import transformers

from rlloom.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_code_config_trains_with_the_sandbox(tmp_path, tiny):
    run = tmp_path / "code"
    # difficulty 1 has 100 distinct functions: a small train set leaves unseen ones to evaluate
    main(["train", str(CONFIGS / "code.yaml"), *tiny, "data.train_size=40", "train.steps=2",
          f"run_dir={run}"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward/correct"] <= 1.0 and 0.0 <= r["reward/format"] <= 1.0
        assert r["reward"] == pytest.approx(r["reward/correct"] + 0.1 * r["reward/format"])


def test_reward_model_term(tmp_path, tiny):
    rm = tmp_path / "rm"
    cfg = transformers.Qwen3Config(vocab_size=98, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, num_labels=1,
                                   pad_token_id=0)
    transformers.Qwen3ForSequenceClassification(cfg).save_pretrained(rm)
    run = tmp_path / "run"
    main(["train", *tiny, f"reward.model_path={rm}", "reward.weights={correct: 1, model: 0.5}",
          f"run_dir={run}"])
    for r in _rows(run):
        assert r["reward/model"] != 0.0
        assert r["reward"] == pytest.approx(r["reward/correct"] + 0.5 * r["reward/model"],
                                            abs=1e-6)


def test_reward_model_with_another_vocabulary_is_refused(tmp_path, tiny, capsys):
    rm = tmp_path / "rm"
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                   pad_token_id=0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(rm)
    with pytest.raises(SystemExit):
        main(["train", *tiny, f"reward.model_path={rm}", f"run_dir={tmp_path / 'run'}"])
    assert "must share the tokenizer" in capsys.readouterr().err


def test_unknown_reward_term(tiny, capsys):
    with pytest.raises(SystemExit):
        main(["train", *tiny, "reward.weights={correct: 1, style: 1}"])
    assert "unknown terms ['style']" in capsys.readouterr().err
