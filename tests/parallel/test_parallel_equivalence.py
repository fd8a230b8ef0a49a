"""Every supported layout against the single-process oracle: same loss, same gradients, same
parameters after one AdamW step, all in float64; and TP greedy generation token for token.

Spawning is the slow part, so one 2-process and one 4-process group each run many cases and
the tests below only read their results. Tolerances: float64 sums taken in a different order
(sharded reductions, all-reduces) differ by ~1e-16 relative; 1e-10 leaves room for that and
still catches any real error, which shows up at 1e-3 or more.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import (
    LR,
    batch,
    full,
    loss_sum,
    max_errors,
    n_tokens,
    plain_name,
    reference_step,
    spawn,
    tiny_model,
)
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy

from rlloom.models.heads import ActorCritic
from rlloom.parallel.apply import (
    full_state_dict,
    load_sharded,
    make_optimizer,
    parallelize,
    save_sharded,
)
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout
from rlloom.models.cache import KVCache
from rlloom.perf.model.memory import DECODE_B, ROLLOUT_B, prefill_bytes_per_token
from rlloom.perf.model.shapes import ModelShape
from rlloom.rollout.engine import Engine, EngineConfig
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.rollout.slot_cache import kv_bytes_per_slot

TOL = {"loss": 1e-10, "grad": 1e-10, "param": 1e-10}

CASES_2 = {
    "dp2 zero0": dict(dp=2, zero=0),
    "dp2 zero1": dict(dp=2, zero=1),
    "dp2 zero2": dict(dp=2, zero=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "dp2 zero3 ac": dict(dp=2, zero=3, activation_checkpointing=True),
    "dp2 zero3 offload": dict(dp=2, zero=3, offload=True),
    "tp2 sp": dict(tp=2),
    "tp2 sp qwen2": dict(tp=2, family="qwen2"),
    "tp2 sp ac": dict(tp=2, activation_checkpointing=True),
    "tp2 sp moe": dict(tp=2, family="qwen3_moe"),
    "dp2 ep2 zero1 moe": dict(dp=2, ep=2, zero=1, family="qwen3_moe"),
    # the families beyond Llama/Qwen: one TP and one ZeRO-3 layout each (OLMo2's TP sums
    # its whole-head norms' squares over the ranks)
    "tp2 sp mixtral": dict(tp=2, family="mixtral"),
    "dp2 zero3 mixtral": dict(dp=2, zero=3, family="mixtral"),
    "dp2 zero3 olmo2": dict(dp=2, zero=3, family="olmo2"),
    "tp2 sp olmo2": dict(tp=2, family="olmo2"),
    "tp2 sp phi3": dict(tp=2, family="phi3"),
    "dp2 zero3 phi3": dict(dp=2, zero=3, family="phi3"),
    "tp2 sp gemma2": dict(tp=2, family="gemma2"),
    "dp2 zero3 gemma2": dict(dp=2, zero=3, family="gemma2"),
    "tp2 sp gemma3": dict(tp=2, family="gemma3_text"),
    "dp2 zero3 gemma3": dict(dp=2, zero=3, family="gemma3_text"),
    "tp2 sp gpt2": dict(tp=2, family="gpt2"),
    "dp2 zero3 gpt2": dict(dp=2, zero=3, family="gpt2"),
    "tp2 sp gpt_oss": dict(tp=2, family="gpt_oss"),
    "tp2 sp smollm3": dict(tp=2, family="smollm3"),
    "dp2 zero3 smollm3": dict(dp=2, zero=3, family="smollm3"),
    "dp2 ep2 zero3 gpt_oss": dict(dp=2, ep=2, zero=3, family="gpt_oss"),
    "dp2 zero3 ac deepseek_v3": dict(dp=2, zero=3, activation_checkpointing=True,
                                     family="deepseek_v3"),
    "dp2 ep2 zero3 deepseek_v3": dict(dp=2, ep=2, zero=3, family="deepseek_v3"),
}
CASES_4 = {
    "dp2 x tp2 zero0": dict(dp=2, tp=2, zero=0),
    "dp2 x tp2 zero1": dict(dp=2, tp=2, zero=1),
    "dp2 x tp2 zero2": dict(dp=2, tp=2, zero=2),
    "dp2 x tp2 zero3 ac": dict(dp=2, tp=2, zero=3, activation_checkpointing=True),
    "dp2 x tp2 ep2 zero2 moe": dict(dp=2, tp=2, ep=2, zero=2, family="qwen3_moe"),
    "dp2 x tp2 ep2 zero1 moe": dict(dp=2, tp=2, ep=2, zero=1, family="qwen3_moe"),
    "dp2 x tp2 zero2 moe": dict(dp=2, tp=2, zero=2, family="qwen3_moe"),
}


def dp_shard(layout: Layout, mesh: DeviceMesh | None
             ) -> tuple[torch.Tensor, torch.Tensor, ProcessGroup | None]:
    """This rank's rows of the batch and its dp group (TP ranks of one dp rank share rows)."""
    ids, mask = batch()
    if mesh is None:
        return ids, mask, None
    r = mesh["dp"].get_local_rank()
    return ids.chunk(layout.dp)[r], mask.chunk(layout.dp)[r], mesh["dp"].get_group()


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, layout: Layout,
               mesh: DeviceMesh | None, errors: dict | None = None,
               ref: dict | None = None) -> float:
    """One AdamW step on this rank's share of the batch; the global loss before it."""
    ids, mask, group = dp_shard(layout, mesh)
    # DP averages gradients over ranks, so each rank's share of the global token mean is
    # scaled by dp; the average of the shares is then the global mean.
    loss = loss_sum(model, ids, mask) / n_tokens(batch()[1]) * layout.dp
    loss.backward()
    total = loss.detach() / layout.dp
    if group is not None:
        dist.all_reduce(total, group=group)
    if ref is not None:
        errors["loss"] = abs(total.item() - ref["loss"])
        errors["grad"] = max_errors(model, ref["grads"], grads=True)
    optim.step()
    optim.zero_grad()
    if ref is not None:
        errors["param"] = max_errors(model, ref["params"], grads=False)
    return total.item()


def assert_sharded(model: torch.nn.Module, optim: torch.optim.Optimizer, layout: Layout
                   ) -> None:
    """The layout really splits the work: a passing comparison is not a replicated model."""
    attn = model.model.layers[0].self_attn
    cfg = model.config
    q = (attn.q_b_proj if cfg.latent else attn.q_proj).weight
    local_rows = q.to_local().shape[0] if hasattr(q, "to_local") else q.shape[0]
    dp_split = layout.dp if layout.zero >= 2 else 1
    q_dim = cfg.qk_head_dim if cfg.latent else cfg.head_dim
    assert local_rows * layout.tp * dp_split == cfg.num_heads * q_dim
    assert attn.n_heads == cfg.num_heads // layout.tp
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    if moe:   # each rank holds its ep share of the experts, each split by tp (and ZeRO)
        experts = list(moe[0].experts.values()) if layout.ep > 1 else list(moe[0].experts)
        assert len(experts) == cfg.n_experts // layout.ep
        w = experts[0].gate_proj.weight
        rows = w.to_local().shape[0] if hasattr(w, "to_local") else w.shape[0]
        zero_split = dp_split if layout.ep == 1 else 1   # routed experts stay out of ZeRO
        assert rows * layout.tp * zero_split == cfg.moe_intermediate_size
    if layout.zero >= 2:   # FSDP2 was told where the shards live
        group = model.model.layers[0]._get_fsdp_state()._fsdp_param_group
        assert isinstance(group.offload_policy, CPUOffloadPolicy) == layout.offload
    n_params = len(list(model.parameters()))
    owned = sum(len(g["params"]) for g in optim.param_groups)
    if layout.zero == 1:
        assert 0 < owned < n_params
    else:
        assert owned == n_params


def one_step(family: str = "qwen3", **layout_kw: Any) -> dict[str, float]:
    """|parallel - reference| of loss, gradients and stepped parameters on this rank."""
    layout = Layout(**layout_kw)
    mesh = build_mesh(layout)
    model = parallelize(tiny_model(0, family), layout, mesh)
    optim = make_optimizer(model, layout, mesh, lr=LR)
    assert_sharded(model, optim, layout)
    errors: dict[str, float] = {}
    train_step(model, optim, layout, mesh, errors, reference_step(0, family))
    return errors


def actor_critic(seed: int = 0) -> ActorCritic:
    model = ActorCritic.from_policy(tiny_model(seed))
    with torch.no_grad():   # from_policy starts the value head at zero; give it gradients
        model.score.weight.copy_(torch.linspace(-1, 1, model.score.weight.numel()))
    return model


def actor_critic_loss(model: ActorCritic, ids: torch.Tensor, mask: torch.Tensor,
                      total_tokens: int) -> torch.Tensor:
    hidden = model.hidden(ids, mask)  # the heads after it, as batch.response_logprobs
    logits, values = model.lm_head(hidden), model.score(hidden).squeeze(-1)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                         reduction="none") * mask[:, 1:].reshape(-1)
    return (ce.sum() + (values.pow(2) * mask).sum()) / total_tokens


def actor_critic_errors() -> dict[str, float]:
    """ZeRO-3 on ActorCritic, whose trunk pass is a method other than forward() (`hidden`) with
    the heads applied after it."""
    layout = Layout(dp=2, zero=3)
    mesh = build_mesh(layout)
    model = parallelize(actor_critic(), layout, mesh)
    ids, mask, group = dp_shard(layout, mesh)
    total = n_tokens(batch()[1])
    loss = actor_critic_loss(model, ids, mask, total) * layout.dp
    loss.backward()
    loss = loss.detach() / layout.dp
    dist.all_reduce(loss, group=group)
    ref = actor_critic()
    ref_loss = actor_critic_loss(ref, *batch(), total)
    ref_loss.backward()
    return {"loss": abs(loss.item() - ref_loss.item()),
            "grad": max_errors(model, {n: p.grad for n, p in ref.named_parameters()}, True)}


@torch.no_grad()
def full_batch_loss(model: torch.nn.Module) -> float:
    ids, mask = batch()
    return (loss_sum(model, ids, mask) / n_tokens(mask)).item()


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {plain_name(n): full(p.detach()) for n, p in model.named_parameters()}


def save_then_reload(path: str, saved_kw: dict[str, Any]) -> dict[str, Any]:
    """Step at `saved_kw`, save, step again; reload the save at TP-2 and step again there.

    Returns the losses after the first step from the saving and the reloaded model, how far
    the two second steps land apart, and (rank 0) what a 1-process reload must reproduce.
    """
    layout = Layout(**saved_kw)
    mesh = build_mesh(layout)
    model = parallelize(tiny_model(0), layout, mesh)
    optim = make_optimizer(model, layout, mesh, lr=LR)
    train_step(model, optim, layout, mesh)
    save_sharded(model, optim, path)
    weights = full_state_dict(model)
    saved_loss = full_batch_loss(model)
    train_step(model, optim, layout, mesh)
    after = params_of(model)

    tp = Layout(tp=2)
    tp_mesh = build_mesh(tp)
    reloaded = parallelize(tiny_model(seed=7), tp, tp_mesh)   # other weights until the load
    tp_optim = make_optimizer(reloaded, tp, tp_mesh, lr=LR)
    load_sharded(reloaded, tp_optim, path)
    out = {"saved loss": saved_loss, "reloaded loss": full_batch_loss(reloaded)}
    train_step(reloaded, tp_optim, tp, tp_mesh)
    mine = params_of(reloaded)
    out["second step"] = max((mine[k] - after[k]).abs().max().item() for k in after)
    if dist.get_rank() == 0:
        out["full state"] = weights
        out["after second step"] = after
    return out


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]


def greedy(model: torch.nn.Module, use_cache: bool) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    return generate(model, PROMPTS, params, eos_id=2, pad_id=0,
                    use_cache=use_cache).response_ids.tolist()


# Two kv heads per TP rank: a KV cache left at the global four would not fit them.
GEN_MODEL = dict(seed=3, std=0.3, heads=8, kv_heads=4)
# MoE: experts split by features; Gemma2: capped scores and logits, sandwich norms; GPT-2:
# learned positions, LayerNorms, a plain MLP
GEN_FAMILIES = ("qwen3", "qwen3_moe", "gemma2", "gpt2", "gpt_oss", "olmo2")


def tp_generation(family: str) -> dict[str, list[list[int]]]:
    layout = Layout(tp=2)
    model = parallelize(tiny_model(**GEN_MODEL, family=family), layout,
                        build_mesh(layout)).eval()
    return {"cache": greedy(model, True), "no cache": greedy(model, False),
            "engine": engine_waves(model)}


def engine_waves(model: torch.nn.Module) -> dict[str, Any]:
    """The engine on a sharded model, its KV budget one row on rank 0 and two on rank 1: the
    rows each plain-loop cache was made for, and what they generated."""
    rows: list[tuple[int, int]] = []

    class Recorded(KVCache):
        def __init__(self, cfg, batch, max_len, dtype, device, kv_heads):
            rows.append((batch, kv_heads))
            super().__init__(cfg, batch, max_len, dtype, device, kv_heads)
    prompt = max(map(len, PROMPTS))
    per_row = kv_bytes_per_slot(model, prompt + 10)
    shape = ModelShape.from_hf_config(model.config.to_hf())
    # the plain loop's rule: every row's outputs, and per row of a wave its KV cache, decode
    # logits and prefill buffers (`memory.generation_slots`)
    row = per_row + DECODE_B * shape.vocab + prompt * prefill_bytes_per_token(shape, 2, prompt)
    config = EngineConfig(kv_budget_bytes=int(ROLLOUT_B * len(PROMPTS) * 10
                                              + row * (1 + dist.get_rank())) + 1)
    with mock.patch("rlloom.rollout.generate.KVCache", Recorded):
        out = Engine(model, config).generate(PROMPTS, SamplingParams(
            max_new_tokens=10, temperature=0.0), eos_id=2, pad_id=0)
    return {"ids": out.response_ids.tolist(), "rows": rows, "per row": per_row}


def run_cases(cases: dict[str, dict], checkpoints: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: one_step(**kw) for name, kw in cases.items()}
    if dist.get_world_size() == 2:
        out["generation"] = {f: tp_generation(f) for f in GEN_FAMILIES}
        out["actor critic zero3"] = actor_critic_errors()
        for name, path in checkpoints.items():
            out[name] = save_then_reload(path, SAVED[name])
    return out


# Sharded checkpoints saved by the 2-process run, reloaded there at TP-2 and here in 1
# process. ZeRO-1 is there for its own optimizer's state.
SAVED = {"fsdp2": dict(dp=2, zero=3), "zero1": dict(dp=2, zero=1)}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def world2(checkpoint_dir) -> list[dict[str, Any]]:
    return spawn(run_cases, 2, CASES_2, {k: str(checkpoint_dir / k) for k in SAVED})


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return spawn(run_cases, 4, CASES_4, {})


def check(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        for what, err in res[case].items():
            assert err < TOL[what], f"{case}: rank {rank} {what} differs by {err:.3g}"


@pytest.mark.parametrize("case", CASES_2)
def test_two_process_layout_matches_single_process(world2, case):
    check(world2, case)


def test_actor_critic_under_zero3(world2):
    check(world2, "actor critic zero3")


@pytest.mark.parametrize("case", CASES_4)
def test_four_process_layout_matches_single_process(world4, case):
    check(world4, case)


@pytest.mark.parametrize("family", GEN_FAMILIES)
def test_tp_greedy_generation_matches_single_process(world2, family):
    plain = tiny_model(**GEN_MODEL, family=family).eval()
    expected = greedy(plain, True)
    assert len({tuple(r) for r in expected}) > 1
    for rank, res in enumerate(world2):
        got = res["generation"][family]
        assert got["cache"] == expected, f"rank {rank} with KV cache"
        assert got["no cache"] == expected, f"rank {rank} without KV cache"
        # the engine's budget holds on a sharded model: one row at a time on both ranks (the
        # smaller budget), each caching its rank's half of the kv heads (two of four; GPT-2's
        # full multi-head attention: four of eight)
        assert got["engine"]["ids"] == expected, f"rank {rank}, engine"
        kv = plain.config.num_kv_heads // 2
        assert got["engine"]["rows"] == [(1, kv)] * len(PROMPTS), got["engine"]
        assert got["engine"]["per row"] == kv_bytes_per_slot(plain, 16) // 2


def test_activation_checkpointing_single_process():
    model = parallelize(tiny_model(0), Layout(activation_checkpointing=True))
    ids, mask = batch()
    loss = loss_sum(model, ids, mask) / n_tokens(mask)
    loss.backward()
    ref = reference_step(0)
    assert abs(loss.item() - ref["loss"]) < 1e-12
    assert max_errors(model, ref["grads"], grads=True) < 1e-12
    assert full(next(model.parameters())).dtype == torch.float64


@pytest.mark.parametrize("saved", SAVED)
def test_sharded_checkpoint_reloads_at_tp2(world2, saved):
    for rank, res in enumerate(world2):
        r = res[saved]
        assert abs(r["reloaded loss"] - r["saved loss"]) < 1e-12, f"rank {rank}"
        # Same weights and same Adam moments: the next step lands in the same place.
        assert r["second step"] < 1e-10, f"rank {rank}: {r['second step']:.3g}"


@pytest.mark.parametrize("saved", SAVED)
def test_sharded_checkpoint_reloads_in_one_process(world2, checkpoint_dir, saved):
    r = world2[0][saved]
    model = tiny_model(seed=7)
    optim = make_optimizer(model, Layout(), None, lr=LR)
    load_sharded(model, optim, checkpoint_dir / saved)
    assert abs(full_batch_loss(model) - r["saved loss"]) < 1e-12
    plain = {k: v for k, v in model.state_dict().items()}
    assert plain.keys() == r["full state"].keys()
    for k, v in r["full state"].items():
        assert torch.equal(plain[k], v), k
    train_step(model, optim, Layout(), None)
    assert max((p.detach() - r["after second step"][n]).abs().max().item()
               for n, p in model.named_parameters()) < 1e-10
