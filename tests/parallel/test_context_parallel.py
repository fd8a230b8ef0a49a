"""Context parallelism (cp=2, and cp=2 x tp=2) against one process: logits, loss and
gradients, with full and sliding-window attention layers and length-dependent (dynamic)
rotary embeddings.

Tolerances (float64): logits, loss and gradients 1e-10 absolute/relative.
"""
import torch
import torch.distributed as dist
from harness import full, loss_of, spawn

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM, positions_and_mask
from rlloom.parallel.apply import parallelize
from rlloom.parallel.context_parallel import (
    apply_context_parallel,
    on_shards,
    shard_positions_and_mask,
    shard_sequence,
)
from rlloom.parallel.data_parallel import local_tensor
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout

TOL = dict(rtol=1e-10, atol=1e-10)


def tiny_model() -> CausalLM:
    # layer 1 attends within a window of 3 keys, which crosses the shard boundary; dynamic
    # rope past 8 positions makes every shard's rotary depend on the whole sequence's length
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      sliding_window=3, sliding_layers=(1,), max_position_embeddings=8,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
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




def test_shard_mask_rows_equal_full_mask_rows():
    _, mask, _ = batch()
    pos, full = positions_and_mask(mask, None)
    for start in (0, 4, 8):
        p, m = shard_positions_and_mask(mask, start, 4)
        assert torch.equal(p, pos[:, start:start + 4])
        assert torch.equal(m, full[:, :, start:start + 4])


def _reference():
    """The batch, its token count, and the one process's model, logits and loss (backward
    done)."""
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    ref = tiny_model()
    ref_logits = ref(ids, mask)
    ref_loss = loss_of(ref_logits, labels, n_tokens)
    ref_loss.backward()
    return ids, mask, labels, n_tokens, ref, ref_logits, ref_loss


def _cp_body():
    ids, mask, labels, n_tokens, ref, ref_logits, ref_loss = _reference()

    model = apply_context_parallel(tiny_model())
    assert set(model.state_dict()) == set(ref.state_dict())
    logits = model(shard_sequence(ids), shard_sequence(mask))
    real = shard_sequence(mask).bool()  # padding's outputs are no one's: left unchecked
    torch.testing.assert_close(logits[real], shard_sequence(ref_logits.detach())[real], **TOL)
    loss = loss_of(logits, shard_sequence(labels), n_tokens)
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
