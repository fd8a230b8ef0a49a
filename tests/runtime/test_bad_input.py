"""Bad input: each case exits with status 2, a message naming the problem, and no run dir."""
import json

import pytest
import torch

from rlloom.cli import main


def _fails(args, capsys, pattern):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert pattern in err, err
    return err


def test_malformed_yaml(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 3\n   lr: 1\n")
    _fails(["train", str(f)], capsys, f"{f}:3")


def test_unknown_key(capsys):
    _fails(["train", "train.step=3"], capsys, "did you mean 'train.steps'")


def test_missing_model_directory(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    _fails(["train", *tiny, f"model.path={tmp_path / 'nope'}", f"run_dir={run}"], capsys,
           "nope' does not exist")
    assert not run.exists()


def test_cuda_requested_without_cuda(tmp_path, tiny, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = tmp_path / "run"
    _fails(["train", *tiny, "train.device=cuda", f"run_dir={run}"], capsys,
           "train.device=cuda but torch.cuda.is_available() is False")
    assert not run.exists()


def _prompt_file(tmp_path, rows):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return f


@pytest.mark.parametrize("bad_row, message", [
    ({"prompt": "Q:1+2="}, "prompts.jsonl:2: missing field 'answer'"),
    ({"prompt": "Q:1+2=", "answer": [3]}, "prompts.jsonl:2: field 'answer' has type list"),
    ({"prompt": "  ", "answer": "3"}, "prompts.jsonl:2: empty prompt"),
    ("{not json", "prompts.jsonl:2: not valid JSON"),
])
def test_prompt_file_bad_row(tmp_path, tiny, capsys, bad_row, message):
    f = _prompt_file(tmp_path, [{"prompt": "Q:1+1=", "answer": "2"}, bad_row])
    run = tmp_path / "run"
    _fails(["train", *tiny, f"data.prompt_file={f}", f"run_dir={run}"], capsys, message)
    assert not run.exists()


def test_prompt_longer_than_limit(tmp_path, tiny, capsys):
    rows = [{"prompt": "Q:1+1=", "answer": "2"}] * 5 + [{"prompt": "Q:" + "1+" * 40 + "1=",
                                                         "answer": "41"}]
    f = _prompt_file(tmp_path, rows)
    run = tmp_path / "run"
    _fails(["train", *tiny, f"data.prompt_file={f}", "data.max_prompt_tokens=32",
            f"run_dir={run}"], capsys, "prompts.jsonl:6: prompt has 84 tokens, more than "
            "data.max_prompt_tokens=32")
    assert not run.exists()


def test_sft_without_solutions_names_the_row_and_few_rows_still_train(tmp_path, tiny, capsys):
    f = _prompt_file(tmp_path, [{"prompt": "Q:1+1=", "answer": "2", "solution": "A:2"},
                                {"prompt": "Q:1+2=", "answer": "3"}])
    _fails(["sft", *tiny, f"data.prompt_file={f}", "--out", str(tmp_path / "m")], capsys,
           "prompts.jsonl:2: no 'solution' field (1 of 2 rows lack one)")
    assert not (tmp_path / "m").exists()
    # solved, two rows fill a batch of 16 by repeating
    f = _prompt_file(tmp_path, [{"prompt": f"Q:1+{i}=", "answer": str(1 + i),
                                 "solution": f"A:{1 + i}"} for i in range(2)])
    main(["sft", *tiny, f"data.prompt_file={f}", "sft.steps=2", "--out", str(tmp_path / "m")])
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_a_layout_that_does_not_fit_the_model_is_refused_before_any_group_starts(tiny,
                                                                                capsys):
    _fails(["train", *tiny, "plan.layouts.actor.tp=2"], capsys,
           "group 'all', actor: tp=2 does not divide the model's num_kv_heads=1")
