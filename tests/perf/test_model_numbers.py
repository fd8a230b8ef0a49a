"""Golden values computed by hand for stated tiny examples, and real parameter counts."""
import subprocess
import sys

import pytest

from rlloom.perf.model import memory as mem
from rlloom.perf.model.shapes import MODELS, ModelShape
from rlloom.plan import Layout

# L=2, d=8, d_ff=32, V=100, 2 heads of 4 (no GQA), plain 2-matrix MLP, tied embeddings.
TINY = ModelShape("tiny", 2, 8, 32, 2, 2, 4, 100, tied_embeddings=True, gated_mlp=False)


def test_tiny_params_and_flops():
    # L (4 d^2 + 2 d d_ff) + V d + norms (2 L d + d) = 2 (256 + 512) + 800 + 40 = 2376
    assert TINY.params == 2376
    # C_f at context 10: 2 * 1536 + 2 L 10 d + 2 V d = 3072 + 320 + 1600
    assert TINY.forward_flops(10) == 4992
    # KV bytes per token: 2 L kv_width * 2 B = 2 * 2 * 8 * 2
    assert TINY.kv_bytes_per_token() == 64


@pytest.mark.parametrize("zero,expected", [(0, 16e9), (1, 8e9 + 8e9 / 8),
                                           (2, 16e9 / 8), (3, 16e9 / 8)])
def test_zero_memory_per_device(zero, expected):
    """A 1B model trained on 8 devices: fp32 weights and gradients (4 + 4 B) and two fp32
    moments (8 B); ZeRO-1 shards the moments, ZeRO-2 and -3 all three (FSDP2 shards the
    weights at rest at ZeRO-2 too)."""
    one_b = ModelShape("1b", 1, 1, 1, 1, 1, 1, 1)
    scale = 1e9 / one_b.params  # state bytes are linear in params
    got = mem.model_state_bytes(one_b, Layout(dp=8, zero=zero), trainable=True) * scale
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("name,count", [("llama-3-8b", 8.03e9), ("qwen2.5-7b", 7.62e9)])
def test_real_param_counts(name, count):
    assert MODELS[name].params == pytest.approx(count, rel=0.01)


def test_perf_does_not_import_torch():
    code = ("import sys, pkgutil, importlib, rlloom.perf as p\n"
            "names = [m.name for m in pkgutil.walk_packages(p.__path__, 'rlloom.perf.')]\n"
            "assert len(names) >= 20, names\n"
            "for name in names: importlib.import_module(name)\n"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_elements_priced_beyond_their_flops():
    """TINY on a device where only attention's per-element work costs (1 ns per score
    element; FLOPs, memory and dispatch free), 4 rows of 63-token responses after 1-token
    prompts, one micro-batch: a forward scores 4 x 64 tokens x 2 layers x 2 heads x 64/2
    keys = 32,768 elements, 32.768 us; training runs 2 epochs of forward + backward (3
    forwards each)."""
    from dataclasses import replace

    from rlloom.perf.model import cost
    from rlloom.perf.model.hardware import hardware
    from rlloom.perf.model.workload import Lengths, Workload
    free = replace(hardware("h100"), peak_flops={"fp32": 1e30, "bf16": 1e30}, mem_bw=1e30,
                   launch_s=0.0, attn_elem_s=1e-9)
    wl = Workload(prompts=4, samples=1, prompt_len=1, response=Lengths.empirical([63] * 4),
                  dtype="fp32", micro_batch_tokens=0, micro_batch=4, ppo_epochs=2,
                  minibatches=1)
    assert cost.forward(TINY, Layout(), wl, free, "reference").seconds == pytest.approx(
        32.768e-6)
    assert cost.training(TINY, Layout(), wl, free, "actor").seconds == pytest.approx(
        2 * 3 * 32.768e-6)
    assert cost.forward(TINY, Layout(), wl, replace(free, attn_elem_s=0.0),
                        "reference").seconds == pytest.approx(0.0, abs=1e-12)
