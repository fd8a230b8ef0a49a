"""A Python reward function drives a run in one process and on a remote Ray group alike: its
term is logged as reward/<name> and, weighted alone, is the reward."""
import json

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.runtime.executor.trainer import train

TOKENS = '''
def n_tokens(prompts, completions, completion_ids, answer, **columns):
    assert len(prompts) == len(completions) == len(answer)
    return [len(ids) / 16 for ids in completion_ids]
'''


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(TOKENS)
    return path


def test_a_python_reward_function_is_the_reward(tmp_path, tiny, reward_file):
    run = tmp_path / "run"
    train(load_config(None, [*tiny, f"reward.functions=[{reward_file}:n_tokens]",
                             f"run_dir={run}"]))
    for row in _rows(run):
        expected = sum(row["response_lens"]) / len(row["response_lens"]) / 16
        assert row["reward/n_tokens"] == pytest.approx(expected, rel=1e-6)
        assert row["reward"] == pytest.approx(expected, rel=1e-6)  # weighted 1, alone
        assert "reward/correct" in row  # the verifier still scores accuracy


pytest.importorskip("ray")


@pytest.mark.usefixtures("ray_cluster")
def test_a_remote_generation_group_loads_the_function(tmp_path, tiny, reward_file):
    run = tmp_path / "ray"
    main(["train", *tiny, f"reward.functions=[{reward_file}:n_tokens]", "train.steps=2",
          "plan.placement=disaggregated", f"run_dir={run}", "--worker-timeout", "300"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        expected = sum(row["response_lens"]) / len(row["response_lens"]) / 16
        assert row["reward/n_tokens"] == pytest.approx(expected, rel=1e-6)
