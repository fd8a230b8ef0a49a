"""`rlloom train --dry-run`: the planner's plan for 64 GPUs passes every check the executor
makes, and a layout that cannot run fails the same way a real start would, without building
or running anything."""
import re

import pytest

from rlloom.cli import main
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import search
from rlloom.perf.search.report import plan_file

# the built-in model with heads a TP of 4 can split
WIDE = ["model.hidden_size=64", "model.heads=4", "model.kv_heads=4"]


def test_the_planners_64_gpu_plan_passes_the_executors_checks(tmp_path, capsys):
    found = search(model_shape("qwen2.5-7b"), "grpo",
                   Workload(512, 8, 512, Lengths("lognormal", 2048, 16384)), hardware("h100"), 64)
    plan = tmp_path / "best.yaml"
    plan.write_text(plan_file(found.ranked[0], "best"))
    main(["train", str(plan), *WIDE, f"run_dir={tmp_path / 'run'}", "--dry-run",
          "--hardware", "h100"])
    out = capsys.readouterr().out
    best = found.ranked[0]
    # on rlloom's engine the tail's decode steps are bound by operator dispatch on any
    # layout, so the best plan generates on 40 devices while the other 24 train and score
    assert (best.plan.placement, best.plan.schedule) == ("disaggregated", "async")
    assert "runs on Ray: generation (40 ranks), actor (24 ranks)" in out
    for role, x in best.plan.layouts.items():  # the generation group holds an actor copy
        name = "actor" if role == "generation" else role
        assert f"{name} pp={x.pp} dp={x.dp} cp={x.cp} tp={x.tp} ep={x.ep} zero={x.zero}" in out
    assert "resources: 64 ranks, 64 CPUs" in out and "memory per device on h100" in out
    assert "dry run: every check passed" in out
    assert not (tmp_path / "run").exists()


def test_a_layout_that_cannot_run_fails_the_dry_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "plan.layouts.actor.tp=2", "model.kv_heads=1", "--dry-run"])
    assert e.value.code == 2
    assert "tp=2 does not divide the model's num_kv_heads=1" in capsys.readouterr().err


def test_the_dry_run_prices_lora_and_tool_turns(capsys):
    """LoRA leaves gradients and optimizer state to the adapters (the frozen base keeps its
    fp32 weights: 4 of a trained weight's 16 B) and skips the frozen weights' gradients in
    backward; three turns re-prefill the conversation: the priced memory and step move
    accordingly."""
    size = ["model.hidden_size=1024", "model.layers=8", "model.heads=16", "model.kv_heads=4"]

    def priced(*extra):
        main(["train", "--dry-run", "--hardware", "h100", *size, *extra])
        gib, step = re.search(r"all ([\d.]+) GiB; predicted step ([\d.]+) s",
                              capsys.readouterr().out).groups()
        return float(gib), float(step)

    full, lora = priced(), priced("model.lora.rank=8")
    turns = priced("rollout.tools=[calculator]", "rollout.max_turns=3")
    # generation's KV cache and buffers set this small model's peak in both; the resident
    # state drops by 12 of 16 B for each of its 0.109B weights: 1.22 GiB
    assert 1.15 < full[0] - lora[0] < 1.3 and lora[1] < full[1]
    assert turns[0] == full[0] and turns[1] > full[1]


def test_rehearse_measures_the_actors_training_before_anything_is_built(tmp_path, capsys):
    """`train --rehearse` runs the actor's micro-batch on fake tensors, prints it beside the
    price and, with --dry-run, stops there; without a device to hold it to, it says what to
    give."""
    main(["train", "--dry-run", "--rehearse", "--hardware", "h100",
          "train.micro_batch_tokens=2304", f"run_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    line = re.search(r"rehearsal: actor training ([\d.]+) GiB per device \(priced ([\d.]+)\) "
                     r"for 4 rows of 512 \+ 64 tokens", out)
    assert line and float(line.group(1)) > 0 and "dry run: every check passed" in out
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as e:
        main(["train", "--rehearse", f"run_dir={tmp_path / 'run'}"])
    assert e.value.code == 2 and "give --hardware NAME" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
