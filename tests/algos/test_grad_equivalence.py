"""Global LossNorm makes gradients independent of how a mini-batch is split.

The whole-batch gradient must equal the sum of micro-batch gradients (accumulated in one
process) and the SUM all-reduce of per-rank gradients (two gloo processes), in float64.
"""
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlloom.algos.aggregation import AGGREGATIONS, LossNorm
from rlloom.algos.kl import KL_ESTIMATORS
from rlloom.algos.policy_losses import POLICY_LOSSES, PolicyLossConfig
from rlloom.models.logprobs import entropy_from_logprobs

D = torch.float64
N, T, V, H = 6, 7, 11, 5  # sequences, response length, vocabulary, feature size


@dataclass
class Problem:
    features: torch.Tensor  # [N, T, H] stand-in for hidden states
    tokens: torch.Tensor  # [N, T] sampled token ids
    old_logp: torch.Tensor  # [N, T]
    prox_logp: torch.Tensor  # [N, T]
    ref_logp: torch.Tensor  # [N, T]
    advantages: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T], one row fully padded


def make_problem() -> tuple[Problem, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(H, V, generator=g, dtype=D))
    features = torch.randn(N, T, H, generator=g, dtype=D)
    tokens = torch.randint(0, V, (N, T), generator=g)
    with torch.no_grad():
        logp = token_logp(features, weight, tokens)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6])
    mask = (torch.arange(T) < lengths[:, None]).to(D)

    def noisy(scale: float) -> torch.Tensor:
        return logp + scale * torch.randn(N, T, generator=g, dtype=D)

    # noise of .3 puts a good share of the ratios outside the clip range
    problem = Problem(features, tokens, old_logp=noisy(0.3), prox_logp=noisy(0.1),
                      ref_logp=noisy(0.5), advantages=torch.randn(N, T, generator=g, dtype=D),
                      mask=mask)
    return problem, weight


def token_logp(features: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor
               ) -> torch.Tensor:
    logits = features @ weight
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def objective(p: Problem, weight: torch.Tensor, rows: slice, loss_name: str, agg_name: str,
              norm: LossNorm) -> torch.Tensor:
    """Policy loss - .01 entropy + .1 k3 KL, each aggregated with the same global norm."""
    logits = p.features[rows] @ weight
    logp = torch.log_softmax(logits, -1).gather(-1, p.tokens[rows, :, None]).squeeze(-1)
    mask = p.mask[rows]
    agg = AGGREGATIONS.get(agg_name)
    policy, _ = POLICY_LOSSES.get(loss_name)(logp, p.old_logp[rows], p.advantages[rows], mask,
                                             PolicyLossConfig(clip_high=0.28, dual_clip=3.0),
                                             p.prox_logp[rows])
    entropy = entropy_from_logprobs(torch.log_softmax(logits, -1))
    kl = KL_ESTIMATORS.get("k3")(logp, p.ref_logp[rows])
    return agg(policy, mask, norm) - 0.01 * agg(entropy, mask, norm) + 0.1 * agg(kl, mask, norm)


def gradient(splits: list[slice], loss_name: str, agg_name: str) -> torch.Tensor:
    problem, weight = make_problem()
    norm = LossNorm.of(problem.mask, const=float(T))
    for rows in splits:
        objective(problem, weight, rows, loss_name, agg_name, norm).backward()
    return weight.grad


SPLITS = {
    1: [slice(0, 6)],
    2: [slice(0, 3), slice(3, 6)],
    3: [slice(0, 1), slice(1, 3), slice(3, 6)],  # uneven on purpose
}


@pytest.mark.parametrize("loss_name", POLICY_LOSSES.names())
@pytest.mark.parametrize("agg_name", AGGREGATIONS.names())
def test_micro_batches_give_the_whole_batch_gradient(agg_name, loss_name):
    whole = gradient(SPLITS[1], loss_name, agg_name)
    assert whole.abs().sum() > 0
    for k in (2, 3):
        torch.testing.assert_close(gradient(SPLITS[k], loss_name, agg_name), whole,
                                   rtol=0, atol=1e-6)


def _rank(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        problem, weight = make_problem()
        per_rank = N // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        # each rank counts its own shard; the SUM all-reduce gives the mini-batch normalisers
        counts = torch.tensor([(problem.mask[rows] > 0).sum(), per_rank], dtype=D)
        dist.all_reduce(counts)
        norm = LossNorm(tokens=counts[0].item(), seqs=counts[1].item(), const=float(T))
        grads = {}
        for agg_name in AGGREGATIONS.names():
            weight.grad = None
            objective(problem, weight, rows, "ppo", agg_name, norm).backward()
            dist.all_reduce(weight.grad)
            grads[agg_name] = weight.grad.clone()
        if rank == 0:
            torch.save(grads, out_file)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_single_process_gradient(tmp_path):
    out_file = tmp_path / "grads.pt"
    mp.spawn(_rank, args=(2, str(tmp_path / "rendezvous"), str(out_file)), nprocs=2)
    grads = torch.load(out_file)
    for agg_name in AGGREGATIONS.names():
        torch.testing.assert_close(grads[agg_name], gradient(SPLITS[1], "ppo", agg_name),
                                   rtol=0, atol=1e-6)
