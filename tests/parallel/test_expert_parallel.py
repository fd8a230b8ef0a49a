"""Expert parallelism (ep=2, ep=2 within dp=4 at ZeRO-2, and ep=2 over dp=2 x cp=2) on a
Qwen3-MoE model against one process: outputs, loss, and gradients of experts, router and
replicated weights. (ep x tp is in test_parallel_equivalence.)

Tolerances (float64): logits, loss and gradients 1e-10 absolute/relative.
"""
import torch
import torch.distributed as dist
from harness import full, loss_of, spawn

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.parallel.apply import parallelize
from rlloom.parallel.context_parallel import on_shards
from rlloom.parallel.data_parallel import local_tensor
from rlloom.parallel.expert_parallel import (
    ExpertGroups,
    ExpertParallelMoE,
    all_reduce_replicated_grads,
    apply_expert_parallel,
    is_expert_parameter,
)
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout

TOL = dict(rtol=1e-10, atol=1e-10)


def tiny_moe() -> CausalLM:
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      n_experts=4, experts_per_token=2, moe_intermediate_size=16,
                      norm_topk_prob=True, mlp_only_layers=(1,))
    model = CausalLM(cfg).double()
    model.init_weights(seed=0, std=0.2)     # a large std spreads the routing over all experts
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = torch.where(mask.bool(), ids, -100).roll(-1, dims=1)
    labels[:, -1] = -100
    labels[~mask.bool()] = -100            # a pad predicts nothing: its output is no one's
    return ids, mask, labels




def _ep_body():
    rank = dist.get_rank()
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    ref = tiny_moe()
    ref_logits = ref(ids, mask)
    ref_loss = loss_of(ref_logits, labels, n_tokens)
    ref_loss.backward()

    model = apply_expert_parallel(tiny_moe())
    blocks = [layer.mlp for layer in model.model.layers]
    assert [type(b) is ExpertParallelMoE for b in blocks] == [True, False, True]
    assert sorted(blocks[0].experts) == [str(2 * rank), str(2 * rank + 1)]
    rows = slice(2 * rank, 2 * rank + 2)                 # each rank holds its own tokens
    logits = model(ids[rows], mask[rows])
    torch.testing.assert_close(logits, ref_logits[rows].detach(), **TOL)
    loss = loss_of(logits, labels[rows], n_tokens)
    loss.backward()
    names = dict(model.named_parameters())
    assert set(names) < set(dict(ref.named_parameters()))   # a slice of the full state
    assert sum(map(is_expert_parameter, names)) == 2 * 2 * 3   # 2 layers x 2 experts x 3
    _same_step_as(model, loss, ref, ref_loss)
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad.abs().sum() > 0


def _same_step_as(model, loss, ref, ref_loss):
    """The ranks' summed loss and every gradient of `model` (its replicated ones reduced)
    equal the one-process `ref`'s."""
    all_reduce_replicated_grads(model)
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL, msg=name)


def test_ep2_forward_backward_match_single_process():
    spawn(_ep_body, 2)


def _idle_rank_body():
    rank = dist.get_rank()
    # Every token picks experts 0 and 1 (rank 0's): rank 1 receives no rows, yet its backward
    # must still join both all-to-alls.
    def block():
        mlp = tiny_moe().model.layers[0].mlp
        with torch.no_grad():
            mlp.gate.weight.copy_(torch.tensor([2.0, 1.0, -1.0, -2.0])[:, None].expand(4, 32))
        return mlp

    x = torch.rand(4, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = block()
    ref_x = x.clone().requires_grad_()
    ref(ref_x).pow(2).sum().backward()
    ep = ExpertParallelMoE(block())
    mine = x[2 * rank:2 * rank + 2].clone().requires_grad_()
    out = ep(mine)
    out.pow(2).sum().backward()
    torch.testing.assert_close(mine.grad, ref_x.grad[2 * rank:2 * rank + 2], **TOL)
    dist.all_reduce(ep.gate.weight.grad)
    torch.testing.assert_close(ep.gate.weight.grad, ref.gate.weight.grad, **TOL)
    for e, expert in ep.experts.items():
        for (name, p), q in zip(expert.named_parameters(), ref.experts[int(e)].parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"expert {e} {name}")


def test_ep2_rank_that_receives_no_tokens():
    spawn(_idle_rank_body, 2)


def _reference():
    """The batch, its token count and the one process's model, its backward done."""
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    ref = tiny_moe()
    loss_of(ref(ids, mask), labels, n_tokens).backward()
    return ids, mask, labels, n_tokens, ref


def _ep_below_dp_body():
    """dp=4, ep=2, ZeRO-2: ranks {0, 1} and {2, 3} each hold all 4 experts, 2 a rank; each rank
    trains on its own row; summed over the two replicas, each expert's gradient is the one
    process's, as are the FSDP-averaged gradients of everything else."""
    rank = dist.get_rank()
    ids, mask, labels, n_tokens, ref = _reference()
    layout = Layout(dp=4, ep=2, zero=2)
    mesh = build_mesh(layout)
    experts = ExpertGroups.of(mesh, 2)
    model = parallelize(tiny_moe(), layout, mesh, mixed_precision=False, experts=experts)
    assert sorted(model.model.layers[0].mlp.experts) == [str(2 * (rank % 2)),
                                                         str(2 * (rank % 2) + 1)]
    rows = slice(rank, rank + 1)
    loss = loss_of(model(ids[rows], mask[rows]), labels[rows], n_tokens) * layout.dp
    loss.backward()
    experts.reduce(model)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, **TOL, msg=name)


def test_ep2_within_dp4_matches_single_process():
    spawn(_ep_below_dp_body, 4)


def _ep_cp_body():
    """dp=2 x cp=2, ep=2, as the executor runs it: each dp replica's rows on sequence shards
    of its cp ranks, experts spread over the dp ranks at each cp coordinate (each expert's
    owners in the two cp ranks route different tokens to it), logits gathered back whole,
    gradients averaged over the cp group."""
    ids, mask, labels, n_tokens, ref = _reference()
    layout = Layout(dp=2, cp=2, ep=2)
    mesh = build_mesh(layout)
    model = parallelize(tiny_moe(), layout, mesh, mixed_precision=False)
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    loss = loss_of(on_shards(model, model, ids[rows], mask[rows]), labels[rows], n_tokens)
    (loss * layout.dp).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = local_tensor(p.grad)
        dist.all_reduce(grad, group=mesh["cp"].get_group())
        grad.div_(layout.cp)
        torch.testing.assert_close(full(p.grad), ref_params[name].grad, **TOL, msg=name)


def test_ep2_over_dp2_x_cp2_matches_single_process():
    spawn(_ep_cp_body, 4)


def _replayed_routes() -> torch.Tensor:
    """Recorded experts [rows, seq, MoE layers, top k] that differ from the model's own
    choice: two distinct random experts per token and layer."""
    g = torch.Generator().manual_seed(7)
    pick = torch.rand(4, 10, 2, 4, generator=g).argsort(-1)[..., :2]
    return pick.to(torch.int16)


def _ep_replay_body():
    from rlloom.models.moe import routing
    rank = dist.get_rank()
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    routes = _replayed_routes()
    ref = tiny_moe()
    with routing(ref, routes) as replayed:
        ref_loss = loss_of(ref(ids, mask), labels, n_tokens)
        ref_loss.backward()
    assert replayed.matched < replayed.counted        # the replay changed the routing
    model = apply_expert_parallel(tiny_moe())
    rows = slice(2 * rank, 2 * rank + 2)
    with routing(model, routes[rows]):               # each rank replays its own rows' routes
        loss = loss_of(model(ids[rows], mask[rows]), labels[rows], n_tokens)
        loss.backward()
    _same_step_as(model, loss, ref, ref_loss)


def test_ep2_replays_recorded_routes_as_one_process():
    """Routing replay through the expert-parallel block: the same recorded experts give the
    same loss and gradients (the router's too, through the replayed experts' weights)."""
    spawn(_ep_replay_body, 2)
