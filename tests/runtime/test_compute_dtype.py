"""`train.compute_dtype`: bf16 matmuls under autocast with fp32 master weights and optimizer
state (what a GPU run does by default), run here on the CPU, where the default stays fp32."""
import torch

from rlloom.cli import main
from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.checkpoint import load_latest
from rlloom.runtime.device import compute_dtype, compute_precision
from rlloom.runtime.stages.batch import response_logprobs


def test_auto_is_bf16_on_gpus_only():
    cpu = torch.device("cpu")
    assert compute_dtype("auto", cpu) is None and compute_dtype("params", cpu) is None
    assert compute_dtype("bfloat16", cpu) == torch.bfloat16


def test_bf16_compute_keeps_fp32_weights_and_stays_close_to_fp32():
    cfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
    model = CausalLM(cfg)
    model.init_weights(seed=3, std=0.3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    rollout = engine_generate(model, [[5, 6, 7], [8, 9]], params, -1, 0,
                              torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = response_logprobs(model, rollout, 1.0)[0]
        ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
        with compute_precision("bfloat16", torch.device("cpu")):
            assert model(ids).dtype == torch.bfloat16
            bf16 = response_logprobs(model, rollout, 1.0)[0]
            again = engine_generate(model, [[5, 6, 7], [8, 9]], params, -1, 0,
                                    torch.Generator().manual_seed(0))  # the KV cache takes it
    keep = rollout.response_mask.bool()
    gap = (bf16 - fp32)[keep].abs()
    assert 0 < gap.max() < 0.1     # bf16 rounding, not another model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert again.response_ids.shape[0] == 2


def test_a_bf16_run_trains_fp32_masters(tmp_path, tiny):
    run = tmp_path / "run"
    main(["train", *tiny, "algo=ppo", "train.steps=2", "train.compute_dtype=bfloat16",
          "algo.overlong=penalty", f"run_dir={run}"])
    _, state = load_latest(run)
    assert {v.dtype for v in state["policy"].values()} == {torch.float32}
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert any(m.abs().sum() > 0 for m in moments)  # it stepped
