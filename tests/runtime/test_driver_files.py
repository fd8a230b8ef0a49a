"""What a node is sent of the driver's files (runtime/executor/ray/files.py): the paths a run
reads, and a fingerprint that tells a copy from a stale or different file at the same path."""
import os
import shutil

from rlloom.config import load_config
from rlloom.runtime.executor.ray.files import _same, fingerprint, input_paths


def test_a_copy_matches_and_a_changed_file_of_the_same_size_does_not(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "weights.bin").write_bytes(bytes(range(256)) * 12_000)  # 3 MiB: head, tail, middle
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert fingerprint(copy) == fingerprint(model)
    data = bytearray((copy / "weights.bin").read_bytes())
    data[-5] ^= 1  # the last MiB, same size
    (copy / "weights.bin").write_bytes(bytes(data))
    assert not _same(copy, fingerprint(model))
    (copy / "weights.bin").write_bytes((model / "weights.bin").read_bytes())
    (copy / "extra.txt").write_text("x")  # a file the driver's copy lacks
    assert not _same(copy, fingerprint(model))
    assert not _same(tmp_path / "absent", fingerprint(model))
    if os.geteuid() != 0:  # root reads anything
        (model / "config.json").chmod(0)
        assert not _same(model, "0")


def test_the_paths_a_run_reads_are_the_model_and_its_input_files(tmp_path):
    prompts, rewards = tmp_path / "prompts.jsonl", tmp_path / "rewards.py"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rewards.write_text("def n(completions, **kw):\n    return [0.0 for _ in completions]\n")
    cfg = load_config(None, [f"data.prompt_file={prompts}", f"reward.functions=[{rewards}:n]",
                             "rollout.tools=[calculator]", "rollout.max_turns=2"])
    assert input_paths(cfg, tmp_path / "model") == [str(tmp_path / "model"), str(prompts),
                                                    str(rewards)]
