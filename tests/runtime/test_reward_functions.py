"""A Python reward function drives a run in one process and on a remote Ray group alike: its
term is logged as reward/<name> and, weighted alone, is the reward."""
import json

import pytest

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.runtime.executor.launch import train

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


CHAT = '''
def turns(prompts, completions, **columns):
    # TRL's conversational convention: prompts are turns, a completion is the assistant turn
    assert all(p[0] == {"role": "system", "content": "Be brief."} for p in prompts)
    assert all(c[0]["role"] == "assistant" for c in completions)
    return [float(len(c[0]["content"]) > 0) for c in completions]
'''


def test_chat_rows_run_through_a_template_file(tmp_path, tiny):
    from rlloom.data.synthetic import generate

    problems = generate("arith", 12, seed=5, difficulty=1)
    rows = [{"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
            for p in problems]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
        "{% endfor %}")
    (tmp_path / "chat_rewards.py").write_text(CHAT)
    run = tmp_path / "run"
    train(load_config(None, [
        *tiny, f"data.prompt_file={tmp_path / 'chat.jsonl'}", "train.steps=2",
        f"data.eval_file={tmp_path / 'held.jsonl'}", f"data.chat_template={tmp_path}/chat.jinja",
        "data.system_prompt=Be brief.", f"reward.functions=[{tmp_path}/chat_rewards.py:turns]",
        f"run_dir={run}"]))
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert "reward/turns" in rows[0] and "reward/correct" in rows[0]
    # the template renders the user turn alone, so the run samples what the same rows given
    # as text sample (same seed, same prompts, token for token)
    for name, part in (("plain.jsonl", problems[:8]), ("plain_held.jsonl", problems[8:])):
        (tmp_path / name).write_text("".join(
            json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in part))
    train(load_config(None, [*tiny, f"data.prompt_file={tmp_path / 'plain.jsonl'}",
                             f"data.eval_file={tmp_path / 'plain_held.jsonl'}", "train.steps=1",
                             f"run_dir={tmp_path / 'text'}"]))
    [text] = _rows(tmp_path / "text")
    assert rows[0]["response_lens"] == text["response_lens"]
    assert rows[0]["reward/correct"] == text["reward/correct"]
