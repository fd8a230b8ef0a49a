"""Python reward functions with TRL's signature: loaded by module or file path, called on a
batch with the row's columns, checked, and their failures named."""
import math
import textwrap

import pytest

from rlloom.config import ConfigError, load_config
from rlloom.rewards.functions import RewardFunctionError, call, load, resolve_spec

SOURCE = textwrap.dedent('''
    import asyncio
    import math

    def exact(prompts, completions, completion_ids, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    async def n_tokens(prompts, completions, completion_ids, **kwargs):
        await asyncio.sleep(0)
        return [len(ids) for ids in completion_ids]

    def seen(prompts, completions, completion_ids, **kwargs):
        return [float(len(kwargs)) for _ in completions]

    def picky(prompts, completions, **kwargs):
        return [1.0 / (c != "boom") for c in completions]

    def short(prompts, completions, **kwargs):
        return [1.0]

    def nan(prompts, completions, **kwargs):
        return [math.nan if c == "x" else 0.0 for c in completions]

    def words(prompts, completions, **kwargs):
        return ["many" for _ in completions]
''')


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(SOURCE)
    return path


def _call(path, name, completions, **columns):
    fname, fn = load(f"{path}:{name}")
    ids = [[7] * len(c) for c in completions]
    return call(fname, fn, ["p"] * len(completions), completions, ids,
                {"answer": ["4"] * len(completions), **columns},
                [f"data.jsonl:{i + 1}" for i in range(len(completions))])


def test_trl_signature_columns_and_async(rewards_file):
    assert _call(rewards_file, "exact", ["4", " 4 ", "5"]) == [1.0, 1.0, 0.0]
    assert _call(rewards_file, "n_tokens", ["abc", "de"]) == [3.0, 2.0]
    assert _call(rewards_file, "seen", ["a"], level=[3]) == [2.0]  # answer and level


def test_a_relative_file_path_is_resolved_against_the_config_directory(tmp_path):
    spec = resolve_spec("rewards/mine.py:score", tmp_path)
    assert spec == f"{tmp_path / 'rewards' / 'mine.py'}:score"
    assert resolve_spec("my_pkg.rewards:score", tmp_path) == "my_pkg.rewards:score"


@pytest.mark.parametrize("name, completions, message", [
    ("picky", ["ok", "boom"], r"'picky' raised ZeroDivisionError.* on sample 1 "
                              r"\(data.jsonl:2\) \(completion 'boom'\)"),
    ("short", ["a", "b"], r"'short' returned 1 values for 2 completions"),
    ("words", ["a"], r"'words' must return a list of numbers"),
])
def test_a_failing_function_is_named_with_the_sample(rewards_file, name, completions, message):
    with pytest.raises(RewardFunctionError, match=message):
        _call(rewards_file, name, completions)


def test_a_nonfinite_reward_is_named_and_left_to_the_step_s_guard(rewards_file, capsys):
    # train.on_nonfinite decides (stop, naming the term, or skip): runtime/stages/nonfinite.py
    values = _call(rewards_file, "nan", ["a", "x"])
    assert values[0] == 0.0 and math.isnan(values[1])
    assert "'nan' returned nan for sample 1 (data.jsonl:2)" in capsys.readouterr().err


def test_load_errors_name_what_is_missing(tmp_path, rewards_file):
    with pytest.raises(RewardFunctionError, match="file .*nowhere.py not found"):
        load(f"{tmp_path / 'nowhere.py'}:f")
    with pytest.raises(RewardFunctionError, match=r"cannot import 'no_such_pkg.rewards' "
                                                  r"\(No module named 'no_such_pkg'\)"):
        load("no_such_pkg.rewards:f")
    with pytest.raises(RewardFunctionError, match="has no function 'absent'"):
        load(f"{rewards_file}:absent")
    with pytest.raises(RewardFunctionError, match="module.path:function"):
        resolve_spec("just_a_name", tmp_path)


def test_config_weighs_functions_one_each_and_checks_names(rewards_file, monkeypatch):
    monkeypatch.chdir(rewards_file.parent)
    cfg = load_config(None, ["reward.functions=[my_rewards.py:exact,my_rewards.py:n_tokens]"])
    assert cfg.reward.weights == {"exact": 1.0, "n_tokens": 1.0}
    assert cfg.reward.functions[0] == f"{rewards_file}:exact"  # absolute: any worker loads it
    cfg = load_config(None, ["reward.functions=[my_rewards.py:exact]",
                             "reward.weights={correct: 1.0, exact: 0.5}"])
    assert cfg.reward.weights == {"correct": 1.0, "exact": 0.5}
    with pytest.raises(ConfigError, match=r"unknown terms \['exakt'\]; terms are correct, "
                                          r"format, model, exact"):
        load_config(None, ["reward.functions=[my_rewards.py:exact]",
                           "reward.weights={exakt: 1.0}"])
    with pytest.raises(ConfigError, match=r"\['exact'\] named twice"):
        load_config(None, ["reward.functions=[my_rewards.py:exact,my_rewards.py:exact]"])
    # a function named like a verifier term never becomes it (nor the run's accuracy)
    (rewards_file.parent / "correct.py").write_text(
        "def correct(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    with pytest.raises(ConfigError, match=r"\['correct'\] named like the task verifier's terms"):
        load_config(None, ["reward.functions=[correct.py:correct]"])
    assert math.isclose(sum(cfg.reward.weights.values()), 1.5)


WILD = textwrap.dedent('''
    import time
    import numpy as np
    import torch

    calls = []

    def sleepy(prompts, completions, **kwargs):
        time.sleep(30)

    def flaky(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("rate limited")
        return [1.0] * len(completions)

    def strings(prompts, completions, **kwargs):
        return ["1.5" for _ in completions]

    def scalars(prompts, completions, **kwargs):
        return [np.float32(0.5), np.int64(2), np.bool_(True), torch.tensor(0.25), True, 3]
''')


@pytest.fixture
def wild_file(tmp_path):
    path = tmp_path / "wild_rewards.py"
    path.write_text(WILD)
    return path


def test_a_hung_function_stops_at_its_timeout_naming_it(wild_file):
    fname, fn = load(f"{wild_file}:sleepy")
    with pytest.raises(RewardFunctionError, match=r"'sleepy' took longer than 0.2 s on a batch "
                                                  r"of 2 \(reward.timeout_s\)"):
        call(fname, fn, ["p"] * 2, ["a", "b"], [[1], [2]], {}, ["", ""], timeout_s=0.2)


def test_a_transient_error_is_retried(wild_file, monkeypatch):
    monkeypatch.setattr("rlloom.rewards.functions._RETRY_WAIT_S", 0.0)
    fname, fn = load(f"{wild_file}:flaky")
    assert call(fname, fn, ["p"] * 2, ["a", "b"], [[1], [2]], {}, ["", ""]) == [1.0, 1.0]


def test_without_retries_a_transient_error_names_no_innocent_sample(wild_file):
    fname, fn = load(f"{wild_file}:flaky")
    fn.__globals__["calls"].clear()
    with pytest.raises(RewardFunctionError, match="on a batch of 2 1 times, though on no "
                                                  "sample alone"):
        call(fname, fn, ["p"] * 2, ["a", "b"], [[1], [2]], {}, ["", ""], retries=0)


def test_numeric_strings_are_not_rewards_but_scalars_are(wild_file):
    fname, fn = load(f"{wild_file}:strings")
    with pytest.raises(RewardFunctionError, match=r"got '1.5' \(str\) for sample 0 \(d:1\)"):
        call(fname, fn, ["p"], ["a"], [[1]], {}, ["d:1"])
    fname, fn = load(f"{wild_file}:scalars")
    assert call(fname, fn, ["p"] * 6, list("abcdef"), [[1]] * 6, {}, [""] * 6) == \
        [0.5, 2.0, 1.0, 0.25, 1.0, 3.0]


def test_a_signature_trl_cannot_call_is_refused_before_any_work(tmp_path):
    (tmp_path / "sig.py").write_text("CALLS = []\ndef only(completions):\n    return [0.0]\n"
                                     "def needs(prompts, completions, completion_ids, level):\n"
                                     "    CALLS.append(1)\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError, match=r"'only' cannot take TRL's arguments \(prompts, "
                                          r"completion_ids missing\)"):
        load_config(None, [f"reward.functions=[{tmp_path / 'sig.py'}:only]"])
    name, fn = load(f"{tmp_path / 'sig.py'}:needs")  # `level` may be a column of the rows
    with pytest.raises(RewardFunctionError, match=r"'needs' cannot be called with this data's "
                                                  r"columns \(prompts, completions, "
                                                  r"completion_ids, answer\)"):
        call(name, fn, ["p"], ["c"], [[1]], {"answer": ["4"]}, [""])
    assert fn.__globals__["CALLS"] == []  # never called, so never retried
