"""Multi-process test harness: gloo process groups on localhost, a tiny model and its
single-process reference step.

`spawn(fn, world, *args)` runs `fn(*args)` in `world` processes that already joined one gloo
group and returns each rank's result. Processes are forked from the suite's forkserver
(tests/conftest.py), which imported torch and rlloom once.
"""
from __future__ import annotations

import datetime
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM

VOCAB = 48
LR = 1e-2


def _entry(rank: int, world: int, out_dir: str, fn: Callable, args: tuple) -> None:
    # One thread each: `world` processes already oversubscribe two cores.
    torch.set_num_threads(1)
    # A rendezvous file, not a port: a free port picked here can be taken by another test's
    # ranks before rank 0 listens on it (EADDRINUSE). A rank that stops early would leave the
    # others waiting forever in a collective: hence the timeout.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(*args)
        with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world: int, *args: Any) -> list[Any]:
    """Results of `fn(*args)` on ranks 0..world-1; a failure re-raises with its traceback."""
    with tempfile.TemporaryDirectory() as out_dir:
        tmp.start_processes(_entry, args=(world, out_dir, fn, args), nprocs=world,
                            start_method="forkserver")
        results = []
        for r in range(world):
            with open(Path(out_dir) / f"{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


# ---- the tiny model, its batch, and the single-process oracle ---------------------------

def tiny_config(family: str = "qwen3", heads: int = 4, kv_heads: int = 2) -> ModelConfig:
    # qwen3 exercises the per-head q/k norms, qwen2 the q/k/v biases, qwen3_moe a dense
    # layer followed by a routed-expert layer, mixtral renormalised routing on every layer,
    # olmo2 norms after the sublayers and over all heads at once.
    moe = dict(n_experts=4, experts_per_token=2, moe_intermediate_size=16,
               mlp_only_layers=(0,)) if family == "qwen3_moe" else \
        dict(n_experts=4, experts_per_token=2, moe_intermediate_size=16,
             norm_topk_prob=True) if family == "mixtral" else {}
    # gemma2: norms before and after each sublayer, scaled embeddings, capped scores and
    # logits, a tied head
    gemma = dict(sandwich_norms=True, norm_offset=True, embed_scale=True, attn_scale=0.3,
                 attn_softcap=3.0, final_softcap=5.0, tie_word_embeddings=True,
                 hidden_act="gelu_pytorch_tanh") if family == "gemma2" else {}
    # gemma3: per-head q/k norms and a sliding first layer with a rotary base of its own
    if family == "gemma3_text":
        gemma = dict(sandwich_norms=True, norm_offset=True, embed_scale=True, attn_scale=0.3,
                     tie_word_embeddings=True, qk_norm=True, local_rope_theta=50.0,
                     sliding_window=4, sliding_layers=(0,))
    # gpt2: learned positions, LayerNorms, biases everywhere, a plain MLP, full multi-head
    # attention, a tied head
    if family == "gpt2":
        gemma = dict(layer_norm=True, gated_mlp=False, learned_positions=True, o_bias=True,
                     mlp_bias=True, tie_word_embeddings=True, hidden_act="gelu_new",
                     max_position_embeddings=64)
        kv_heads = heads
    # gpt-oss: sinks, biased router and experts with a low clamp, a sliding first layer
    if family == "gpt_oss":
        moe = dict(n_experts=4, experts_per_token=2, moe_intermediate_size=16,
                   norm_topk_prob=True, router_bias=True, expert_bias=True, swiglu_limit=0.5)
        gemma = dict(attn_sinks=True, o_bias=True, sliding_window=4, sliding_layers=(0,))
    # deepseek_v3: latent attention (a q bottleneck, interleaved rotary pairs), a dense first
    # layer, then sigmoid routing within the best 2 of 4 groups, scaled, and a shared expert
    if family == "deepseek_v3":
        moe = dict(n_experts=8, experts_per_token=2, moe_intermediate_size=16,
                   norm_topk_prob=True, mlp_only_layers=(0,), moe_scoring="sigmoid", n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)
        gemma = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=12,
                     rope_interleave=True)
        kv_heads = heads
    # smollm3: no positional embedding on its second layer, a tied head
    if family == "smollm3":
        gemma = dict(nope_layers=(1,), tie_word_embeddings=True)
    return ModelConfig(family=family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=32 // heads, qkv_bias=family in ("qwen2", "gpt2", "gpt_oss"),
                       qk_norm=family in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"),
                       qk_norm_whole=family == "olmo2", post_norms=family == "olmo2", **moe,
                       **{k: v for k, v in gemma.items() if k != "qk_norm"})


def tiny_model(seed: int = 0, family: str = "qwen3", std: float = 0.2, **shape: int
               ) -> CausalLM:
    model = CausalLM(tiny_config(family, **shape))
    model.init_weights(seed, std=std)
    return model.double()


def batch(rows: int = 4, seq: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [rows, seq]: left-padded rows of different lengths.

    The model sees seq - 1 = 9 inputs, which tp=2 sequence shards split unevenly (5 + 4).
    """
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : i % 3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def loss_sum(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy over real target tokens."""
    logits = model(ids[:, :-1], mask[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, VOCAB).double(), ids[:, 1:].reshape(-1),
                         reduction="none")
    return (ce * mask[:, 1:].reshape(-1)).sum()


def n_tokens(mask: torch.Tensor) -> int:
    return int(mask[:, 1:].sum())


def reference_step(seed: int = 0, family: str = "qwen3") -> dict[str, Any]:
    """Loss, gradients and post-AdamW parameters of one single-process step in float64."""
    model = tiny_model(seed, family)
    ids, mask = batch()
    loss = loss_sum(model, ids, mask) / n_tokens(mask)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR).step()
    return {"loss": loss.item(), "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: all ranks call it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_errors(model: torch.nn.Module, ref: dict[str, torch.Tensor], grads: bool
               ) -> float:
    """Largest |parallel - reference| over every parameter (or its gradient)."""
    worst = 0.0
    for name, p in model.named_parameters():
        t = full(p.grad if grads else p.detach())
        worst = max(worst, (t - ref[plain_name(name)]).abs().max().item())
    return worst


def loss_of(logits, labels, n_tokens):
    """Summed next-token cross-entropy over a global token count (labels -100 are skipped)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum") / n_tokens
