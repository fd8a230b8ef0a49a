"""Pipeline parallelism against one process: loss, gradients, an AdamW step and scoring.

Tolerances (float64): loss and gradients 1e-10 absolute/relative; after an AdamW step (whose
update divides by sqrt(v) + eps and so amplifies 1e-16 gradient differences) 1e-9.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import spawn

from rlloom.models.config import ModelConfig
from rlloom.models.heads import ActorCritic
from rlloom.models.transformer import CausalLM
from rlloom.parallel.apply import load_sharded, parallelize_pipeline, save_sharded
from rlloom.parallel.expert_parallel import ExpertGroups
from rlloom.parallel.mesh import build_mesh
from rlloom.parallel.pipeline import PipelinedModel, stage_layers
from rlloom.plan import Layout

TOL = dict(rtol=1e-10, atol=1e-10)


def tiny_model(layers: int = 4, tied: bool = False) -> CausalLM:
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      tie_word_embeddings=tied)
    model = CausalLM(cfg).double()
    model.init_weights(seed=0, std=0.1)
    return model


def batch(rows: int = 8, seq: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                       # left padding: positions must still line up
    mask[-2, :5] = 0
    labels = torch.where(mask.bool(), ids, -100).roll(-1, dims=1)
    labels[:, -1] = -100
    labels[~mask.bool()] = -100           # a pad predicts nothing: its output is no one's
    return ids, mask, labels


def next_token_loss(pipe, normaliser):
    """Cross-entropy of the last stage's hidden states through its head, summed over a
    microbatch's labels [mb, seq] (-100 = ignored) / normaliser."""
    def loss_fn(hidden, labels):
        return F.cross_entropy(pipe.module.lm_head(hidden).flatten(0, 1), labels.flatten(),
                               ignore_index=-100, reduction="sum") / normaliser
    return loss_fn


def reference(ids, mask, labels, tied=False):
    model = tiny_model(tied=tied)
    logits = model(ids, mask)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / (labels != -100).sum()
    loss.backward()
    return model, loss.detach()


def check_grads(stage_module, ref_model, **tol):
    ref = dict(ref_model.named_parameters(remove_duplicate=False))  # a tied weight by both names
    names = [n for n, _ in stage_module.named_parameters()]
    assert names, "stage owns no parameters"
    for name, p in stage_module.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        name = name.replace("._checkpoint_wrapped_module", "")  # checkpointed layers' names
        torch.testing.assert_close(grad, ref[name].grad, **(tol or TOL), msg=name)


def _pp_body():
    ids, mask, labels = batch()
    ref_model, ref_loss = reference(ids, mask, labels)
    model = tiny_model()
    pipe = PipelinedModel(model, n_microbatches=4)
    n_tokens = (labels != -100).sum().item()
    loss = pipe.train_step(ids, mask, labels, next_token_loss(pipe, n_tokens))
    torch.testing.assert_close(loss, ref_loss, **TOL)          # broadcast to every stage
    check_grads(pipe.module, ref_model)

    # One AdamW step on each side, then forward-only scoring and a second training step on a
    # batch of another shape (stages are rebuilt per call).
    for params in (ref_model.parameters(), pipe.module.parameters()):
        torch.optim.AdamW(params, lr=1e-2).step()
    ids2, mask2, labels2 = batch(rows=4, seq=6)
    hidden = pipe.score(ids2, mask2)  # the last stage's final hidden states
    if pipe.is_last:
        with torch.no_grad():
            torch.testing.assert_close(pipe.module.lm_head(hidden), ref_model(ids2, mask2),
                                       rtol=1e-9, atol=1e-9)
    else:
        assert hidden is None
    for m in (ref_model, model):
        m.zero_grad()
    n2 = (labels2 != -100).sum()
    ref_loss2 = F.cross_entropy(ref_model(ids2, mask2).flatten(0, 1), labels2.flatten(),
                                ignore_index=-100, reduction="sum") / n2
    ref_loss2.backward()
    loss2 = pipe.train_step(ids2, mask2, labels2, next_token_loss(pipe, n2.item()))
    torch.testing.assert_close(loss2, ref_loss2.detach(), rtol=1e-9, atol=1e-9)
    check_grads(pipe.module, ref_model, rtol=1e-9, atol=1e-9)


def test_stage_layers_balance():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]


def test_pp2_1f1b_training_and_scoring_match_single_process():
    spawn(_pp_body, 2)


def _dp_pp_body():
    rank = dist.get_rank()
    # Mesh (pp=2, dp=2), pp outermost as in rlloom.parallel.mesh: rank = pp_i * 2 + dp_i.
    pp_i, dp_i = divmod(rank, 2)
    pp_groups = [dist.new_group([d, 2 + d]) for d in range(2)]
    dp_groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(2)]
    ids, mask, labels = batch()
    ref_model, ref_loss = reference(ids, mask, labels)
    n_tokens = (labels != -100).sum().item()                  # normaliser of the global batch
    rows = slice(4 * dp_i, 4 * dp_i + 4)
    pipe = PipelinedModel(tiny_model(), pp_groups[dp_i], n_microbatches=2)
    loss = pipe.train_step(ids[rows], mask[rows], labels[rows], next_token_loss(pipe, n_tokens))
    dist.all_reduce(loss, group=dp_groups[pp_i])
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for p in pipe.module.parameters():
        dist.all_reduce(p.grad, group=dp_groups[pp_i])
    check_grads(pipe.module, ref_model)


def test_dp2_x_pp2_matches_single_process():
    spawn(_dp_pp_body, 4)


def _model_of(cfg: ModelConfig) -> CausalLM:
    model = CausalLM(cfg).double()
    model.init_weights(seed=0, std=0.2)
    return model


def _reference_of(cfg: ModelConfig, ids, mask, labels):
    """One process's model of `cfg` after backward of the batch's mean loss, and the loss."""
    model = _model_of(cfg)
    loss = F.cross_entropy(model(ids, mask).flatten(0, 1), labels.flatten(),
                           ignore_index=-100, reduction="sum") / (labels != -100).sum()
    loss.backward()
    return model, loss.detach()


def _pp_ep_body():
    """pp2 x dp2, ep2, ZeRO-2, as the executor builds it (`parallelize_pipeline`): each
    stage's experts spread over its 2 dp ranks, the rest sharded; loss, gradients, the
    clipped norm (experts' squares summed over the ep ranks) and the gathered weights equal
    the one process's."""
    cfg = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                      n_experts=4, experts_per_token=2, moe_intermediate_size=16,
                      norm_topk_prob=True, mlp_only_layers=(1,))
    ids, mask, labels = batch()
    n_tokens = (labels != -100).sum()
    ref_model, ref_loss = _reference_of(cfg, ids, mask, labels)
    layout = Layout(pp=2, dp=2, ep=2, zero=2)
    mesh = build_mesh(layout)
    experts = ExpertGroups.of(mesh, 2)
    pipe = parallelize_pipeline(_model_of(cfg), layout, mesh, experts=experts)
    dp_i = mesh["dp"].get_local_rank()
    held = {int(n.split(".experts.")[1].split(".")[0]) for n, _ in pipe.module.named_parameters()
            if ".experts." in n}
    assert held == {2 * dp_i, 2 * dp_i + 1}          # this rank's half of the stage's experts
    rows = slice(4 * dp_i, 4 * dp_i + 4)
    # dp averages the replicas' gradients: each replica's loss is dp times its share
    loss = pipe.train_step(ids[rows], mask[rows], labels[rows],
                           next_token_loss(pipe, n_tokens.item() / layout.dp))
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    torch.testing.assert_close(loss / layout.dp, ref_loss.detach(), **TOL)
    check_grads(pipe.module, ref_model)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e-3)
    torch.testing.assert_close(pipe.clip_grad_norm(1e-3, experts.ep), ref_norm, **TOL)
    state = pipe.full_state()
    assert set(state) == set(ref_model.state_dict())
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, **TOL, msg=name)


def test_pp2_x_dp2_with_ep2_matches_single_process():
    spawn(_pp_ep_body, 4)


def _pp_latent_body():
    """pp=2 of DeepSeek-V3's blocks (latent attention, a dense first layer, grouped sigmoid
    routing and a shared expert in the rest): loss and gradients equal one process's."""
    from dataclasses import replace
    from harness import tiny_config
    cfg = replace(tiny_config("deepseek_v3"), vocab_size=64, num_layers=4)
    ids, mask, labels = batch()
    ref_model, ref_loss = _reference_of(cfg, ids, mask, labels)
    pipe = PipelinedModel(_model_of(cfg), n_microbatches=4)
    loss = pipe.train_step(ids, mask, labels,
                           next_token_loss(pipe, (labels != -100).sum().item()))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    check_grads(pipe.module, ref_model)


def test_pp2_of_latent_attention_and_shared_experts_matches_single_process():
    spawn(_pp_latent_body, 2)


def _train_and_clip(pipe, ref_model, ref_loss, ids, mask, labels):
    """One pipelined training step of a tied model: its loss and gradients, and its clipped
    norm (the tied embedding counted once), equal the one process's."""
    loss = pipe.train_step(ids, mask, labels, next_token_loss(pipe, (labels != -100).sum().item()))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    pipe.sync_tied_grads()
    check_grads(pipe.module, ref_model)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e-3)
    torch.testing.assert_close(pipe.clip_grad_norm(1e-3), ref_norm, **TOL)


def _pp_tp_body():
    """pp=2 x tp=2: each stage's layers split over 2 TP ranks (tied embeddings on both ends):
    loss, gradients, the clipped norm and forward-only scoring equal one process's."""
    ids, mask, labels = batch()
    ref_model, ref_loss = reference(ids, mask, labels, tied=True)
    mesh = build_mesh(Layout(pp=2, tp=2))
    pipe = PipelinedModel(tiny_model(tied=True), mesh["pp"].get_group(), n_microbatches=4,
                          tp_mesh=mesh["tp"])
    attn = next(iter(pipe.module.model.layers.values())).self_attn
    assert attn.n_heads == 2 and attn.q_proj.weight.to_local().shape[0] == 16  # half the heads
    _train_and_clip(pipe, ref_model, ref_loss, ids, mask, labels)
    hidden = pipe.score(ids, mask)
    if pipe.is_last:
        with torch.no_grad():
            torch.testing.assert_close(pipe.module.lm_head(hidden), ref_model(ids, mask), **TOL)


def test_pp2_x_tp2_matches_single_process():
    spawn(_pp_tp_body, 4)


def _pp_tp_ckpt_body():
    """pp=2 x tp=2 with activation checkpointing, as the executor builds it
    (`parallelize_pipeline`: the stage's TP, then checkpointing, which once came first and
    left the layers unsharded beside sharded inputs): loss, gradients and norm exact."""
    ids, mask, labels = batch()
    ref_model, ref_loss = reference(ids, mask, labels, tied=True)
    layout = Layout(pp=2, tp=2, activation_checkpointing=True)
    pipe = parallelize_pipeline(tiny_model(tied=True), layout, build_mesh(layout))
    _train_and_clip(pipe, ref_model, ref_loss, ids, mask, labels)


def test_pp2_x_tp2_with_checkpointing_matches_single_process():
    spawn(_pp_tp_ckpt_body, 4)


def _pp_cp_body():
    """pp=2 x cp=2 on sequences of 7 (padded to 8, 4 positions a cp rank): loss, gradients
    (averaged over the cp ranks, which each computed the loss on the gathered logits) and
    forward-only scoring equal one process's."""
    ids, mask, labels = batch(seq=7)
    ref_model, ref_loss = reference(ids, mask, labels)
    mesh = build_mesh(Layout(pp=2, cp=2))
    pipe = PipelinedModel(tiny_model(), mesh["pp"].get_group(), n_microbatches=4,
                          cp_group=mesh["cp"].get_group())
    loss = pipe.train_step(ids, mask, labels, next_token_loss(pipe, (labels != -100).sum().item()))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    for p in pipe.module.parameters():
        dist.all_reduce(p.grad, group=mesh["cp"].get_group())
        p.grad /= 2
    check_grads(pipe.module, ref_model)
    hidden = pipe.score(ids, mask)
    if pipe.is_last:
        with torch.no_grad():
            real = mask.bool()  # padding's outputs are no one's: left unchecked
            torch.testing.assert_close(pipe.module.lm_head(hidden)[real],
                                       ref_model(ids, mask)[real], **TOL)


def test_pp2_x_cp2_matches_single_process():
    spawn(_pp_cp_body, 4)


def _actor_critic_body():
    """A shared actor-critic over 2 stages: the last stage appends the value to its hidden
    states;
    a loss on both (next-token cross-entropy + squared value error) and its gradients, the
    value head's too, equal one process's."""
    ids, mask, labels = batch()
    goal = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    n = (labels != -100).sum().item()

    def loss_of(logits, values, target):
        labels = target[..., 0].long()
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                             reduction="sum")
        return (ce + ((values - target[..., 1]) ** 2).sum()) / n

    def model():
        ac = ActorCritic.from_policy(tiny_model())
        torch.nn.init.normal_(ac.score.weight, std=0.3, generator=torch.Generator().manual_seed(3))
        return ac
    ref = model()
    hidden = ref.hidden(ids, mask)  # the heads after it, as batch.response_logprobs
    logits, values = ref.lm_head(hidden), ref.score(hidden).squeeze(-1)
    target = torch.stack([labels.double(), goal], -1)
    ref_loss = loss_of(logits, values, target)
    ref_loss.backward()
    pipe = PipelinedModel(model(), n_microbatches=4)
    loss = pipe.train_step(ids, mask, target, lambda out, target: loss_of(
        pipe.module.lm_head(out[..., :-1]), out[..., -1], target))
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_grads(pipe.module, ref)
    assert pipe.is_last == ("score.weight" in dict(pipe.module.named_parameters()))


def test_shared_actor_critic_over_2_stages_matches_single_process():
    spawn(_actor_critic_body, 2)


def _tied_pp4_body():
    """4 stages of a model whose lm_head is its embedding: the first and last stage each hold
    the weight; summed over the pair, their gradients are the one weight's, the clipped norm
    counts it once, and the gathered state is the whole model's."""
    ids, mask, labels = batch()
    ref_model, ref_loss = reference(ids, mask, labels, tied=True)
    pipe = PipelinedModel(tiny_model(tied=True), n_microbatches=4,
                          tied_group=dist.new_group([0, 3]))
    _train_and_clip(pipe, ref_model, ref_loss, ids, mask, labels)
    check_grads(pipe.module, ref_model)                     # clipped alike
    state = pipe.full_state()
    assert state.keys() == ref_model.state_dict().keys()
    for name, value in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], value, **TOL)


def test_tied_embeddings_over_4_stages_match_single_process():
    spawn(_tied_pp4_body, 4)


def _pp_checkpoint_body(path):
    """Stages hold different parameters: a sharded checkpoint keeps each stage's weights and
    AdamW state (hyperparameters included) apart, and a run resumed from it steps exactly as
    the uninterrupted one."""
    ids, mask, labels = batch()
    pipes = [PipelinedModel(tiny_model(), n_microbatches=2) for _ in range(2)]
    optims = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in pipes]
    n = (labels != -100).sum().item()
    pipes[0].train_step(ids, mask, labels, next_token_loss(pipes[0], n))
    optims[0].step()
    save_sharded(pipes[0].module, optims[0], path)
    load_sharded(pipes[1].module, optims[1], path)
    for pipe, optim in zip(pipes, optims):
        optim.zero_grad()
        pipe.train_step(ids, mask, labels, next_token_loss(pipe, n))
        optim.step()
    for a, b in zip(pipes[0].parameters(), pipes[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert optims[1].param_groups[0]["betas"] == (0.9, 0.999)


def test_pp2_sharded_checkpoint_resumes_exactly(tmp_path):
    spawn(_pp_checkpoint_body, 2, str(tmp_path / "ckpt"))
