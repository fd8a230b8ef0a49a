"""LoRA runs: only the adapters change, the reference is the base model (the KL starts at
exactly zero), `final/` is the merged model plus a PEFT adapter, a resumed run continues the
adapters, and a remote generation group receives the adapters alone."""
import json

import pytest
import torch
from safetensors.torch import load_file

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.runtime.checkpoint import checkpoint_dirs, load_latest
from rlloom.runtime.default_model import ensure_default_model

# the soft overlong penalty gives groups unequal rewards, so the adapters get a gradient
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algo.kl_coef=0.05", "train.lr=1e-2",
        "algo.overlong=penalty"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_lora_run_trains_adapters_against_the_base_model(tmp_path, tiny):
    peft = pytest.importorskip("peft")
    import transformers

    run = tmp_path / "run"
    # one optimizer step per RL step, so step 1's KL is measured before any update
    main(["train", *tiny, *LORA, "algo.epochs=1", "algo.minibatches=1", f"run_dir={run}"])
    rows = _rows(run)
    assert abs(rows[0]["kl"]) < 1e-7  # B = 0: the policy is its reference until it trains
    assert rows[-1]["kl"] > 1e-5
    base = ensure_default_model(load_config(None, tiny))
    start = load_file(str(base / "model.safetensors"))
    state = load_latest(run)[1]["policy"]
    adapters = {k for k in state if k.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 7 * 2  # 7 projections per layer, 2 layers
    for name, value in start.items():  # the base weights did not move
        assert torch.equal(state[name], value), name
    assert any(state[k].abs().sum() > 0 for k in adapters if k.endswith("lora_B"))
    # final/ is the merged model; final/adapter loads onto the base with peft, same logits
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "final").eval()
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base), run / "final" / "adapter")
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (merged(input_ids=ids).logits - adapted.eval()(input_ids=ids).logits).abs().max()
    assert diff < 1e-5


def test_a_resumed_lora_run_continues_the_adapters(tmp_path, tiny):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    main(["train", *tiny, *LORA, f"run_dir={whole}"])
    main(["train", *tiny, *LORA, "train.steps=2", f"run_dir={cut}"])
    main(["train", "--resume", str(cut), "train.steps=3"])
    assert [r["loss"] for r in _rows(cut)] == [r["loss"] for r in _rows(whole)]
    assert len(checkpoint_dirs(cut)) >= 1


pytest.importorskip("ray")


@pytest.mark.usefixtures("ray_cluster")
def test_a_remote_generation_group_receives_only_the_adapters(tmp_path, tiny):
    run = tmp_path / "ray"
    main(["train", *tiny, *LORA, "train.steps=2", "plan.placement=disaggregated",
          f"run_dir={run}", "--worker-timeout", "300"])
    rows = _rows(run)
    # rank 4 adapters on the 7 projections of 2 layers: r (in + out) fp32 numbers each
    c = load_config(None, tiny).model
    hidden, kv, head = c.hidden_size, c.kv_heads, c.hidden_size // c.heads
    ffn = json.loads((ensure_default_model(load_config(None, tiny)) / "config.json")
                     .read_text())["intermediate_size"]
    shapes = [(hidden, hidden), (hidden, kv * head), (hidden, kv * head), (hidden, hidden),
              (hidden, ffn), (hidden, ffn), (ffn, hidden)]
    adapter_bytes = 2 * sum(4 * (i + o) * 4 for i, o in shapes)
    assert all(r["sync_bytes"] == adapter_bytes for r in rows)
