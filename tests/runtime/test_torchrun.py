"""`rlloom train` under torchrun with 2 processes: FSDP resumed as TP, a hybrid layout (TP
generation, FSDP training), pipeline stages and LoRA under ZeRO-3, 3 steps each on the default
task (tiny sizes)."""
import json
import os
import subprocess
import sys

import pytest
from tiny_run import TINY

from rlloom.cli import main

LAYOUTS = {
    "fsdp": ["plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3"],
    "tp": ["plan.layouts.actor.tp=2"],
    # with bf16 compute, as on a GPU: FSDP gathers bf16 weights, the TP generation copy and
    # its KV cache are bf16, the fp32 masters are resharded into it after each step
    "hybrid": ["plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3",
               "plan.layouts.generation.tp=2", "train.compute_dtype=bfloat16",
               "algo.kl_coef=0.05"],
    # the executor's roles run here too: pipeline stages, generation on 2 whole copies
    "pp": ["plan.layouts.actor.pp=2"],
    # LoRA adapters beside frozen base weights in the same ZeRO-3 shards
    "lora_zero3": ["plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3",
                   "model.lora.rank=4", "algo.kl_coef=0.05"],
}


def _torchrun(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    # faulthandler prints each rank's Python stack if it dies on a signal (SIGABRT from C++)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", "--standalone", "-m", "rlloom", "train", *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def _why(done: subprocess.CompletedProcess) -> str:
    """What the ranks printed before torchrun's agent reported the failure: one rank's crash
    shows up on the others as a closed connection and in the agent's report only as a signal,
    which alone hides the cause."""
    lines = done.stderr.splitlines()
    agent = next((i for i, line in enumerate(lines)
                  if "closing signal" in line or "failed (exitcode" in line), len(lines))
    return "\n".join(lines[:agent])[-6000:]


def _check(run, stdout: str) -> list[dict]:
    """Three finite steps of the whole batch, the last checkpoint and the final model; only
    rank 0 prints."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(v == v for v in (r["loss"], r["reward"], r["grad_norm"]))  # finite, not nan
        assert len(r["response_lens"]) == 4 * 4  # the whole batch: B prompts x K samples
    assert (run / "final" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step_000003" / "actor").is_dir()
    assert stdout.count("held-out greedy accuracy: before RL") <= 1
    return rows


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> tuple[list[str], str]:
    """The tiny run with KV heads TP can split, and its SFT warm start (both ranks load the
    same weights), made once for the module's runs."""
    tiny = [*TINY, "model.kv_heads=2"]
    out = tmp_path_factory.mktemp("warm")
    main(["sft", *tiny, "--out", str(out)])
    return tiny, f"model.path={out}"


# fsdp and tp run in test_sharded_checkpoint_resumes_at_another_layout (and FSDP training
# in hybrid): one torchrun start each fewer
@pytest.mark.parametrize("name", ["hybrid", "pp", "lora_zero3"])
def test_train_runs_under_torchrun(name, tmp_path, warm):
    run = tmp_path / name
    tiny, model = warm
    # a small token budget: several micro-batches per mini-batch, as many on every rank
    done = _torchrun([*tiny, *LAYOUTS[name], model,
                      "train.prompts_per_step=4", "train.micro_batch_tokens=40",
                      f"run_dir={run}"], tmp_path)
    assert done.returncode == 0, _why(done)
    rows = _check(run, done.stdout)
    assert done.stdout.count("held-out greedy accuracy: before RL") == 1
    if name == "hybrid":
        assert all(r["reshard_bytes"] > 0 and r["reshard_s"] > 0 for r in rows)
    if name == "lora_zero3":
        assert (run / "final" / "adapter" / "adapter_model.safetensors").is_file()


def test_wrong_world_size_is_a_clear_error(tmp_path, tiny, monkeypatch, capsys):
    """Checked before the process joins the world, from the variables torchrun sets: one
    process with them says what torchrun would (no torchrun start needed to show it)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop:
        main(["train", *tiny, "plan.layouts.actor.dp=4", f"run_dir={tmp_path / 'r'}"])
    assert stop.value.code != 0
    assert "plan.layouts.actor uses 4 processes but torchrun started 2" in \
        capsys.readouterr().err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_sharded_checkpoint_resumes_at_another_layout(tmp_path, warm):
    """2 steps with FSDP over 2 ranks, then `--resume` with TP over 2 ranks: the sharded
    checkpoint is read into the new layout and the run continues at step 3."""
    tiny, model = warm
    run = tmp_path / "run"
    args = [*tiny, model, "train.prompts_per_step=4",
            "train.micro_batch_tokens=40"]
    first = _torchrun([*args, "train.steps=2", *LAYOUTS["fsdp"], f"run_dir={run}"], tmp_path)
    assert first.returncode == 0, _why(first)
    assert first.stdout.count("held-out greedy accuracy: before RL") == 1
    again = _torchrun(["--resume", str(run), "train.steps=3", "plan.layouts.actor.dp=1",
                       "plan.layouts.actor.zero=0", *LAYOUTS["tp"]], tmp_path)
    assert again.returncode == 0, _why(again)
    assert f"resuming {run} at step 2" in again.stdout
    _check(run, again.stdout)


def test_torchrun_plans_pass_the_trainers_checks(tmp_path):
    """Every plan `rlloom plan --runtime torchrun` ranks is one the torchrun trainer accepts,
    with TP degrees its sharding takes (KV heads and the MLP split too), and priced with the
    generation copy the trainer reshards every step when the actor trains data-parallel."""
    from rlloom.config import load_config
    from rlloom.perf.model.hardware import hardware
    from rlloom.perf.model.shapes import model_shape
    from rlloom.perf.model.workload import Lengths, Workload
    from rlloom.perf.search.planner import search
    from rlloom.perf.search.report import plan_file
    from rlloom.runtime.executor.preflight import torchrun_problems
    wl = Workload(512, 8, 512, Lengths("lognormal", 2048, 16384))
    for model, devices in (("qwen2.5-7b", 64), ("qwen2.5-1.5b", 8)):  # 1.5b: 2 KV heads
        shape = model_shape(model)
        for algo in ("grpo", "ppo"):
            ranked = search(shape, algo, wl, hardware("h100"), devices,
                            runtime="torchrun").ranked
            assert len(ranked) >= 10
            for p in ranked:
                path = tmp_path / "plan.yaml"
                path.write_text(plan_file(p, "test"))
                cfg = load_config(path, [f"algo.name={algo}"])
                assert torchrun_problems(cfg, devices) == []
                for x in cfg.plan.layouts.values():
                    assert shape.kv_heads % x.tp == 0 and shape.ffn % x.tp == 0
                if p.plan.layout("actor").dp > 1:
                    assert p.sync_s > 0


def test_a_plan_file_for_torchrun_runs_as_written(tmp_path, warm):
    """`rlloom plan --runtime torchrun --write-plan` for 2 GPUs, then `torchrun rlloom train
    PLAN_FILE` with the tiny model standing in for the priced one."""
    plan = tmp_path / "plan.yaml"
    main(["plan", "--model", "qwen2.5-0.5b", "--runtime", "torchrun", "--gpus", "2xH100",
          "--p50", "512", "--p99", "2048", "--write-plan", str(plan)])
    tiny, model = warm
    run = tmp_path / "run"
    done = _torchrun([str(plan), *tiny, model, "train.steps=2",
                      f"run_dir={run}"], tmp_path)
    assert done.returncode == 0, _why(done)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    from rlloom.config import load_config
    ran, written = load_config(run / "config.yaml"), load_config(plan)
    assert ran.plan == written.plan and ran.plan.layouts["actor"].world_size == 2
    # the priced micro-batch of sequences at the longest context
    assert ran.train.micro_batch_tokens % (512 + 2048) == 0
