"""Context parallelism (cp=2, and cp=2 x tp=2) against one process: logits, loss and
gradients, with full and sliding-window attention layers and length-dependent (dynamic)
rotary embeddings, learned positions (GPT-2), replayed routes and DeepSeek-V3's latent
attention.

Tolerances (float64): logits, loss and gradients 1e-10 absolute/relative.
"""
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
from harness import full, loss_of, spawn, tiny_config

from rlloom.models.config import ModelConfig
from rlloom.models.moe import routing
from rlloom.models.transformer import CausalLM, packed_order, unpack
from rlloom.parallel.apply import parallelize
from rlloom.parallel.context_parallel import (
    PackedShard,
    apply_context_parallel,
    on_shards,
    shard_sequence,
)
from rlloom.parallel.data_parallel import local_tensor
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout

TOL = dict(rtol=1e-10, atol=1e-10)


def tiny_model(kind: str = "qwen3") -> CausalLM:
    # layer 1 attends within a window of 3 keys, which crosses the shard boundary, with a
    # rotary base of its own (Gemma3's local layers); dynamic rope past 8 positions makes
    # every shard's rotary depend on the whole sequence's length
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      sliding_window=3, sliding_layers=(1,), max_position_embeddings=8,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                      local_rope_theta=50.0)
    if kind == "gpt2":  # each shard embeds its packed positions from the learned table
        cfg = ModelConfig(family="gpt2", vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
                          layer_norm=True, gated_mlp=False, learned_positions=True,
                          qkv_bias=True, o_bias=True, mlp_bias=True, hidden_act="gelu_new",
                          max_position_embeddings=16, tie_word_embeddings=True)
    if kind == "deepseek":  # latent attention, grouped sigmoid routing (replayed), shared expert
        cfg = replace(tiny_config("deepseek_v3"), vocab_size=64)
    if kind == "moe":  # routed experts on both layers, replayed below
        cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32,
                          intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          head_dim=8, qk_norm=True, n_experts=4, experts_per_token=2,
                          moe_intermediate_size=16)
    model = CausalLM(cfg).double()
    model.init_weights(seed=0, std=0.1)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0                        # padding inside the first shard
    mask[2, :8] = 0                        # padding across the shard boundary
    labels = torch.where(mask.bool(), ids, -100).roll(-1, dims=1)
    labels[:, -1] = -100
    labels[~mask.bool()] = -100            # a pad predicts nothing: its output is no one's
    return ids, mask, labels




def test_a_shard_of_packed_rows_sees_the_keys_up_to_its_own_queries():
    """Rank 1 of 3 (positions 4-7 of rows packed real tokens first): rotary positions count
    real tokens and repeat the last on padding; full layers attend causally to keys 0-7
    (lower-right aligned, no mask tensor), the window layer to the 3 keys behind each
    query; every row's outputs come back to token order."""
    _, mask, _ = batch()
    cfg = tiny_model().config
    shard = PackedShard.of(cfg, mask, 4, 4)
    assert shard.keys == 8 and shard.longest == 12
    assert shard.positions.tolist() == [[4, 5, 6, 7], [4, 5, 6, 7], [3, 3, 3, 3]]
    dense = torch.ones(4, 8, dtype=torch.bool).tril(4)
    assert shard.masks[0] is None  # `Attention` aligns causal attention to the last key
    band = dense & (torch.arange(4, 8)[:, None] - torch.arange(8)[None, :] < 3)
    assert torch.equal(shard.masks[1][0, 0], band)
    x = torch.arange(36.).view(3, 12)
    assert torch.equal(unpack(x.gather(1, shard.order), shard.order), x)


def _replayed_routes() -> torch.Tensor:
    """Recorded experts [rows, seq, MoE layers, top k] unlike the model's own: two distinct
    random experts per token and layer."""
    g = torch.Generator().manual_seed(7)
    return torch.rand(3, 12, 2, 4, generator=g).argsort(-1)[..., :2].to(torch.int16)


def _replaying(model, kind: str):
    return routing(model, _replayed_routes()) if kind in ("moe", "deepseek") else nullcontext()


def _reference(kind: str = "qwen3"):
    """The batch, its token count, and the one process's model, logits and loss (backward
    done; an MoE model's with recorded routes replayed)."""
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    ref = tiny_model(kind)
    with _replaying(ref, kind) as replayed:
        ref_logits = ref(ids, mask)
        ref_loss = loss_of(ref_logits, labels, n_tokens)
        ref_loss.backward()
    if kind in ("moe", "deepseek"):
        assert replayed.matched < replayed.counted  # the replay changed the routing
    return ids, mask, labels, n_tokens, ref, ref_logits, ref_loss


def _cp_body():
    for kind in ("qwen3", "gpt2", "moe", "deepseek"):
        _cp_matches(kind)
    _cp_replays_rows_it_pads()


def _cp_replays_rows_it_pads() -> None:
    """Rows of 11 tokens, which `on_shards` pads to 12 for cp=2: the replay has no routes
    for the pad and its logits still equal one process's."""
    ids, mask, _ = batch()
    ids, mask, routes = ids[:, :11], mask[:, :11], _replayed_routes()[:, :11]
    ref = tiny_model("moe")
    model = parallelize(tiny_model("moe"), Layout(cp=2), build_mesh(Layout(cp=2)))
    with torch.no_grad(), routing(ref, routes), routing(model, routes):
        expected, logits = ref(ids, mask), on_shards(model, model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], **TOL)


def _cp_matches(kind: str) -> None:
    """One sequence-sharded forward and backward of `kind` equal to one process's (an MoE
    model's replaying the same recorded routes: each shard reads its tokens' routes)."""
    ids, mask, labels, n_tokens, ref, ref_logits, ref_loss = _reference(kind)

    model = apply_context_parallel(tiny_model(kind))
    assert set(model.state_dict()) == set(ref.state_dict())
    # the backbone returns this rank's shard of the packed rows (real tokens first)
    order = packed_order(mask)
    with _replaying(model, kind):
        logits = model(shard_sequence(ids), shard_sequence(mask))
    def packed(t):
        index = order.view(*order.shape, *[1] * (t.dim() - 2)).expand(*order.shape, *t.shape[2:])
        return shard_sequence(t.gather(1, index))
    real, ref_shard, labels_shard = (packed(t) for t in (mask, ref_logits.detach(), labels))
    real = real.bool()  # padding's outputs are no one's: left unchecked
    torch.testing.assert_close(logits[real], ref_shard[real], **TOL)
    loss = loss_of(logits, labels_shard, n_tokens)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)


def test_cp2_forward_backward_match_single_process():
    spawn(_cp_body, 2)


def _cp_tp_body():
    """cp=2 x tp=2 as the executor runs it: `on_shards` gathers the logits back whole, the
    loss is computed on every rank, and the gradients are averaged over the cp group."""
    ids, mask, labels, n_tokens, ref, ref_logits, ref_loss = _reference()
    layout = Layout(cp=2, tp=2)
    mesh = build_mesh(layout)
    model = parallelize(tiny_model(), layout, mesh)
    assert model.model.layers[0].self_attn.n_heads == 2  # this rank's half of the heads
    logits = on_shards(model, model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits.detach()[real], **TOL)
    loss = loss_of(logits, labels, n_tokens)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
    loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = local_tensor(p.grad)
        dist.all_reduce(grad, group=mesh["cp"].get_group())
        grad.div_(2)
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, **TOL, msg=name)


def test_cp2_x_tp2_forward_backward_match_single_process():
    spawn(_cp_tp_body, 4)
