"""Rehearsal: the runtime's own training micro-batch on fake tensors, in a fake world, held
to bytes counted by hand."""
import json

import pytest

from rlloom.cli import main
from rlloom.perf.model.shapes import MODELS
from rlloom.rehearsal.compare import parse_layout
from rlloom.rehearsal.train import model_config, rehearse_training
from rlloom.plan import Layout

SMALL = MODELS["qwen2.5-0.5b"]


@pytest.mark.parametrize("dp", [1, 4])
def test_state_bytes_per_rank_are_fp32_weights_grads_and_two_moments(dp: int) -> None:
    """fp32 weights, fp32 gradients and two fp32 AdamW moments, sharded 1/dp by ZeRO-3 (FSDP
    pads each parameter's shard to a multiple of dp rows: under 0.1% here)."""
    n = model_config(SMALL).num_params
    r = rehearse_training(SMALL, Layout(dp=dp, zero=3 if dp > 1 else 0), 1, 64, 64)
    assert r.params == pytest.approx(4 * n / dp, rel=1e-3)
    assert r.grads == pytest.approx(4 * n / dp, rel=1e-3)
    assert r.optimizer == pytest.approx(8 * n / dp, rel=1e-3)
    assert r.peak > r.params + r.optimizer


def test_rehearse_cli_prints_the_model_beside_the_rehearsal(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    main(["rehearse", "--model", "qwen2.5-0.5b", "--layout", "dp=4,zero=3", "--rows", "2",
          "--prompt-len", "32", "--response-len", "96", "--json", str(out)])
    text = capsys.readouterr().out
    assert "rank 0 of 4" in text and "model/rehearsed" in text
    report = json.loads(out.read_text())
    assert set(report["rank0"]) == {"params", "grads", "optimizer", "transient", "peak", "flops"}
    row = report["rank0"]["params"]
    assert row["ratio"] == pytest.approx(row["model"] / row["rehearsed"])


def test_a_bad_layout_is_one_line_naming_the_key(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["rehearse", "--layout", "dp=4,zro=3"])
    assert stop.value.code == 2
    assert "zro" in capsys.readouterr().err
    assert parse_layout("tp=2,activation_checkpointing=true") == Layout(
        tp=2, activation_checkpointing=True)
