"""Faults a user's files, functions and disk cause, injected into real runs of the tiny model:
each asserts what the user sees (one line, the right exit code, no traceback) and what is on
disk (nothing outside the run's own files touched, nothing half-written, nothing lost)."""
import errno
import json
import os
import subprocess
import sys
import time

import pytest
from safetensors import SafetensorError

import rlloom.models.hf_io as hf_io
from rlloom.cli import main
from rlloom.runtime.outputs import files

REWARDS = '''
import sys
def raises(prompts, completions, completion_ids, **kw):
    raise ValueError("boom")
def exits(prompts, completions, completion_ids, **kw):
    sys.exit(0)
def interrupts(prompts, completions, completion_ids, **kw):
    raise KeyboardInterrupt
def nan(prompts, completions, completion_ids, **kw):
    return [float("nan")] * len(completions)
def per_prompt(prompts, completions, completion_ids, **kw):
    return [float(sum(map(ord, p)) % 7) for p in prompts]
'''


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _stops(args, capsys, code):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def rewards(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def test_sft_and_eval_never_replace_a_path_that_holds_files(tmp_path, tiny, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    err = _stops(["sft", *tiny, "--out", str(out)], capsys, 2)
    assert f"--out {out} already holds notes.txt" in err and "--overwrite" in err
    report = tmp_path / "eval.json"
    report.write_text("{}")
    err = _stops(["eval", str(out), "--out", str(report)], capsys, 2)
    assert f"--out {report} already holds a file" in err
    assert (out / "notes.txt").read_text() == "keep me" and report.read_text() == "{}"
    main(["sft", *tiny, "--out", str(out), "--overwrite"])
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()


@pytest.mark.parametrize("fn, said", [
    ("raises", "reward function 'raises' raised ValueError: boom on sample 0"),
    ("exits", "reward function 'exits' raised SystemExit(0) on a batch of"),
    ("interrupts", "reward function 'interrupts' raised KeyboardInterrupt() on a batch of"),
])
def test_a_failing_reward_function_is_one_line_and_exit_2(tmp_path, tiny, capsys, rewards, fn,
                                                           said):
    err = _stops(["train", *tiny, f"reward.functions=[{rewards}:{fn}]", "reward.retries=0",
                  f"run_dir={tmp_path / 'run'}"], capsys, 2)
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err


def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, tiny, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.exit(3)\n")
    err = _stops(["train", *tiny, f"reward.functions=[{bad}:f]", f"run_dir={tmp_path / 'r'}"],
                 capsys, 2)
    assert f"importing {bad} raised SystemExit: 3" in err


def test_a_nonfinite_reward_follows_on_nonfinite_and_names_the_reward(tmp_path, tiny, capsys,
                                                                      rewards):
    args = [*tiny, f"reward.functions=[{rewards}:nan]", "reward.weights={correct: 1, nan: 1}"]
    err = _stops(["train", *args, f"run_dir={tmp_path / 'stop'}"], capsys, 3)
    assert "step 1: the reward is not finite" in err
    assert "Likely cause: reward/nan returned NaN or inf" in err
    assert "smaller train.lr" not in err
    main(["train", *args, "train.on_nonfinite=skip", f"run_dir={tmp_path / 'skip'}"])
    assert [r["nonfinite_skips"] > 0 for r in _rows(tmp_path / "skip")] == [True] * 3


def _enospc_on(monkeypatch, name, after=0):
    """Writing (or syncing) a file called `name` fails with ENOSPC after `after` writes."""
    seen = []

    def failing(real, counts):
        def call(fd, *args):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
                seen.extend([1] * counts)
                if len(seen) > after:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, *args)
        return call
    monkeypatch.setattr(files.os, "write", failing(os.write, 1))
    monkeypatch.setattr(files.os, "fsync", failing(os.fsync, 0))


def test_a_full_disk_at_a_metrics_row_is_one_line_and_cuts_nothing(tmp_path, tiny, capsys,
                                                                   monkeypatch):
    run = tmp_path / "run"
    _enospc_on(monkeypatch, "metrics.jsonl", after=1)
    err = _stops(["train", *tiny, f"run_dir={run}"], capsys, 1)
    assert err.startswith(f"error: cannot write {run}/metrics.jsonl: No space left on device")
    assert [r["step"] for r in _rows(run)] == [1]  # whole rows only
    monkeypatch.undo()
    main(["train", "--resume", str(run)])
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]


def test_a_full_disk_at_the_final_model_is_one_line_and_the_run_resumes(tmp_path, tiny, capsys,
                                                                        monkeypatch):
    run = tmp_path / "run"

    def full(*args, **kwargs):
        raise SafetensorError("I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(hf_io, "save_file", full)
    err = _stops(["train", *tiny, f"run_dir={run}"], capsys, 1)
    assert f"error: cannot write {run}/final: No space left on device" in err
    assert not (run / "final").exists() and not list(run.glob(".final.*"))
    monkeypatch.undo()
    main(["train", "--resume", str(run), "train.steps=4"])
    assert (run / "final/model.safetensors").is_file()


def test_ctrl_c_before_the_first_step_is_one_line(tmp_path, tiny, capsys, monkeypatch):
    import rlloom.runtime.executor.launch as launch

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(launch, "ensure_default_model", interrupted)
    err = _stops(["train", *tiny, f"run_dir={tmp_path / 'run'}"], capsys, 130)
    assert err.startswith("interrupted: rlloom train stopped before it finished")


@pytest.fixture
def finished(tmp_path, tiny):
    run = tmp_path / "run"
    main(["train", *tiny, f"run_dir={run}"])
    return run


def test_a_full_disk_while_resuming_leaves_config_yaml_whole(finished, capsys, monkeypatch):
    before = (finished / "config.yaml").read_text()
    _enospc_on(monkeypatch, "config.yaml.tmp", after=-1)  # its first write (Python's own)
    err = _stops(["train", "--resume", str(finished), "train.steps=4"], capsys, 1)
    assert f"cannot write {finished}/config.yaml: No space left on device" in err
    assert (finished / "config.yaml").read_text() == before


@pytest.mark.parametrize("edit, refused", [
    (("kl_coef: 0.001", "kl_coef: 0.5"), "--resume cannot change algo.kl_coef"),
    (("seed: 0", "seed: 7"), "--resume cannot change seed"),
    (None, "config.yaml is empty; copy the checkpoint's own"),
])
def test_a_hand_edited_config_is_held_to_the_resume_rules(finished, capsys, edit, refused):
    path = finished / "config.yaml"
    text = path.read_text()
    assert edit is None or edit[0] in text
    path.write_text(text.replace(*edit) if edit else "")
    err = _stops(["train", "--resume", str(finished), "train.steps=4"], capsys, 2)
    assert refused in err, err
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3]  # nothing ran


def test_a_hand_edited_resumable_field_is_applied_and_recorded(finished):
    path = finished / "config.yaml"
    path.write_text(path.read_text().replace("steps: 3", "steps: 4", 1))
    main(["train", "--resume", str(finished)])
    assert [r["step"] for r in _rows(finished)] == [1, 2, 3, 4]
    [record] = [json.loads(line) for line in (finished / "resumes.jsonl").read_text().splitlines()]
    assert record["changes"] == {"train.steps": [3, 4]}


def _prompt_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_repeated_prompt_is_never_both_trained_on_and_held_out(tmp_path, capsys):
    from rlloom.config import load_config
    from rlloom.data.prompts import load_prompt_sets
    rows = [{"prompt": f"Q{i}?", "answer": str(i)} for i in range(40)] * 3
    path = _prompt_file(tmp_path / "p.jsonl", rows)
    cfg = load_config(None, ["data.task=arith", f"data.prompt_file={path}",
                             "data.eval_fraction=0.25"])
    sets = load_prompt_sets(cfg.data, seed=0)
    held, trained = {p.prompt for p in sets.eval}, {p.prompt for p in sets.train}
    assert held and trained and not held & trained
    assert (len(held), len(sets.eval), len(sets.train)) == (10, 30, 90)
    assert "80 of 120 rows repeat another row's prompt" in capsys.readouterr().out


def test_a_data_file_changed_before_a_resume_is_refused_unless_accepted(tmp_path, tiny, capsys):
    rows = [{"prompt": f"Q:{i}+1=", "answer": str(i + 1)} for i in range(1, 9)]
    data = _prompt_file(tmp_path / "p.jsonl", rows)
    run = tmp_path / "run"
    main(["train", *tiny, "data.task=arith", f"data.prompt_file={data}", f"run_dir={run}"])
    _prompt_file(data, rows[:-1])
    err = _stops(["train", "--resume", str(run), "train.steps=4"], capsys, 2)
    assert f"--resume {run}: data.prompt_file changed since the run started" in err
    assert "--accept-changed-data" in err
    main(["train", "--resume", str(run), "train.steps=4", "--accept-changed-data"])
    [record] = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert list(record["changes"]) == ["train.steps", "data.prompt_file (contents)"]


def test_rewards_alike_within_every_prompt_are_named_after_three_steps(tmp_path, tiny, capsys,
                                                                         rewards):
    main(["train", *tiny, f"reward.functions=[{rewards}:per_prompt]",
          "reward.weights={per_prompt: 1}", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert ("warning: steps 1-3: every prompt's 4 responses scored alike "
            "(frac_zero_std_groups=1), so every grpo advantage was 0") in err


_STORE = """
import sys, time
from rlloom import api
rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(160_000)]
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
print(api._dataset_file(rows, "train"))
"""


def test_processes_storing_the_same_rows_at_one_moment_all_read_them_whole(tmp_path):
    start = time.time() + 3.0  # every process has imported rlloom by then
    env = {**os.environ, "RLLOOM_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _STORE, str(start)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-500:] for o in outs]
    [path] = {o[0].strip() for o in outs}
    with open(path) as f:
        assert sum(1 for _ in f) == 160_000
    assert not [p for p in (tmp_path / "cache/api/datasets").iterdir()
                if p.name.startswith(".")]


_BUILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from tiny_run import TINY
from rlloom.config import load_config
from rlloom.runtime.default_model import ensure_default_model
cfg = load_config(None, TINY)
while time.time() < float(sys.argv[1]):
    time.sleep(0.001)
print(ensure_default_model(cfg))
"""


def test_runs_starting_at_one_moment_build_the_default_model_once(tmp_path):
    start = time.time() + 4.0
    env = {**os.environ, "RLLOOM_CACHE": str(tmp_path / "cache")}
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(start), tests_dir], env=env,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 3, [o[1][-500:] for o in outs]
    said = "".join(o[0] for o in outs)
    assert said.count("building the built-in model") == 1, said
    [path] = {o[0].strip().splitlines()[-1] for o in outs}
    assert (tmp_path / "cache" / "models").is_dir() and os.path.isfile(f"{path}/config.json")


def test_sft_trains_a_prompt_file_s_solutions_as_written(tmp_path, tiny, monkeypatch):
    import rlloom.runtime.default_model as default_model
    rows = [{"prompt": f"Q:{i}+1=", "answer": str(i + 1), "solution": f"{i}+1={i + 1}.A:{i + 1}"}
            for i in range(1, 9)]
    seen = []
    monkeypatch.setattr(default_model, "supervised_finetune",
                        lambda model, tokenizer, problems, *args, **kw: seen.extend(problems))
    data = _prompt_file(tmp_path / "p.jsonl", rows)
    main(["sft", *tiny, "data.task=arith", f"data.prompt_file={data}",
          "--out", str(tmp_path / "out")])
    assert sorted(p.solution for p in seen) == sorted(r["solution"] for r in rows)


def test_sft_with_lora_trains_and_exports_adapters(tmp_path, tiny):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import rlloom.runtime.default_model as default_model
    from rlloom.config import load_config
    base = default_model.ensure_default_model(load_config(None, tiny))
    out = tmp_path / "out"
    main(["sft", *tiny, f"model.path={base}", "model.lora.rank=4", "sft.steps=5",
          "sft.lr=1e-2", "--out", str(out)])
    adapters = load_file(out / "adapter/adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if "lora_B" in k)  # it trained
    # the merged model is the base with the adapters applied, as peft computes it
    merged = AutoModelForCausalLM.from_pretrained(out)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(merged(ids).logits, peft(ids).logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(merged(ids).logits,
                              AutoModelForCausalLM.from_pretrained(base)(ids).logits)


def test_an_error_in_rows_given_in_memory_names_the_row_s_index():
    from rlloom import api
    from rlloom.data.prompts import read_prompt_file
    from rlloom.data.row_files import DataError
    rows = [{"prompt": "Q:1+1=", "answer": "2"}, {"prompt": "Q:2+2="}]
    with pytest.raises(DataError, match=r"^train_dataset row 1: missing field 'answer'"):
        read_prompt_file(api._dataset_file(rows, "train"), "arith")


def test_sft_without_a_verifier_needs_no_reward_function(tmp_path, tiny, monkeypatch):
    import rlloom.runtime.default_model as default_model
    from rlloom.config import ConfigError, load_config
    model = default_model.ensure_default_model(load_config(None, tiny))
    rows = [{"prompt": f"Q:{i}+1=", "solution": f"A:{i + 1}"} for i in range(1, 9)]
    data = _prompt_file(tmp_path / "p.jsonl", rows)
    args = [f"model.path={model}", "data.task=none", f"data.prompt_file={data}", "sft.steps=2"]
    with pytest.raises(ConfigError, match="nothing rewards a response"):  # RL still needs one
        load_config(None, args)
    seen = []
    monkeypatch.setattr(default_model, "supervised_finetune",
                        lambda model, tokenizer, problems, *a, **kw: seen.extend(problems))
    main(["sft", *args, "--out", str(tmp_path / "out")])
    assert sorted(p.solution for p in seen) == sorted(r["solution"] for r in rows)
