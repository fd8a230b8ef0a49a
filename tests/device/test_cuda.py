"""The GPU path on a CUDA device (skipped where there is none; CI has none): the model against
transformers in fp32 and bf16, generation log-probs against the trainer's, a sharded-free
checkpoint round trip, and a GRPO run with `train.device=cuda`.

`RLLOOM_TEST_DEVICE=cpu` runs the same checks on the CPU, to try `bench/device_check.sh`
before a device is lent.
"""
import json
import os

import pytest
import torch
import transformers

from rlloom.cli import main
from rlloom.models.hf_io import load_model, save_checkpoint
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import response_logprobs

DEVICE = os.environ.get("RLLOOM_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA device (RLLOOM_TEST_DEVICE=cpu: on CPU)")
# largest |logit difference| from transformers: fp32 kernels differ in summation order only;
# bf16 rounds every activation (8 bits of mantissa)
TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    cfg = transformers.Qwen3Config(vocab_size=len(build_char_tokenizer()), hidden_size=256,
                                   intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=256, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_matches_transformers_on_the_device(checkpoint, dtype):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    ours = load_model(checkpoint, dtype)
    ids = torch.randint(3, 60, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.to(DEVICE).eval()(input_ids=ids.to(DEVICE)).logits.float()
        got = ours.to(DEVICE).eval()(ids.to(DEVICE)).float()
    assert (got - ref).abs().max().item() < TOL[dtype]


def test_sampled_logprobs_equal_the_trainers_on_the_device(checkpoint):
    model = load_model(checkpoint).to(DEVICE).eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]] * 4
    params = SamplingParams(max_new_tokens=32, temperature=0.8)
    out = engine_generate(model, prompts, params, eos_id=2, pad_id=0,
                          generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        lp, _, _ = response_logprobs(model, out, 0.8)
    assert out.response_mask.sum() > 0
    assert ((lp - out.logprobs) * out.response_mask).abs().max().item() < 1e-3


def test_checkpoint_round_trip_on_the_device(checkpoint, tmp_path):
    model = load_model(checkpoint, torch.bfloat16).to(DEVICE).eval()
    save_checkpoint(model, build_char_tokenizer(), tmp_path / "out")
    back = load_model(tmp_path / "out", torch.bfloat16).to(DEVICE).eval()
    ids = torch.arange(3, 40, device=DEVICE)[None]
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))


def test_grpo_trains_on_the_device(tmp_path, tiny):
    run = tmp_path / "run"
    main(["train", *tiny, f"train.device={DEVICE}", f"run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 and r["grad_norm"] == r["grad_norm"] for r in rows)
