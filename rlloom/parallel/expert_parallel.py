"""Expert parallelism: each MoE layer's experts sharded over the ranks of an ep group.

Rank r owns experts [r * E / ep, (r + 1) * E / ep); the router and everything outside the MoE
blocks stay replicated. Ranks hold different tokens (ep spans data-parallel ranks). In each MoE
block every rank routes its own tokens, sends each (token, chosen expert) row to the expert's
owner with one all-to-all, the owner runs its experts, a second all-to-all brings the outputs
back, and the origin rank weights them by its router probabilities and sums per token. Both
all-to-alls are differentiable (the backward of an all-to-all is the all-to-all with the splits
swapped), so expert gradients from every rank's tokens accumulate on the owner, and router
gradients stay with the tokens.

Gradients: expert parameters are complete on their owner; replicated parameters hold each
rank's partial sum and must be all-reduced (sum, with a loss normalised over all ranks' tokens)
over the ep group -- `all_reduce_replicated_grads` does that, or a data-parallel layer that skips
`is_expert_parameter` names.

With ep below dp (`ExpertGroups`), the dp ranks split into dp / ep expert groups of ep
consecutive ranks; each group holds every expert once, so an expert has dp / ep replicas,
one per group, each holding the gradient of its own group's tokens: summing them over the
replicas (`ExpertGroups.reduce`) gives the gradient of every rank's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rlloom.models.moe import MoEBlock, choose, run_experts, split_expert_inputs


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with explicit split sizes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return (_AllToAll.apply(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group),
                None, None, None)


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable all-to-all: rows [in_splits[j]] of x go to rank j; returns the rows
    received, [out_splits[j]] from rank j, in rank order."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class ExpertParallelMoE(nn.Module):
    """An `MoEBlock` with only this rank's experts. Experts keep their global index as name
    (`experts.5.up_proj.weight`), so a rank's state dict is a slice of the full one."""

    def __init__(self, block: MoEBlock, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        if block.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide n_experts={block.n_experts}; use an ep "
                             "that divides the number of experts")
        self.group, self.ep = group, ep
        self.n_experts, self.top_k = block.n_experts, block.top_k
        self.routing = block.routing
        self.n_local = block.n_experts // ep
        self.first = rank * self.n_local
        self.gate = block.gate
        self.tp_group = block.tp_group
        self.moe_index, self.routes = block.moe_index, block.routes
        self.experts = nn.ModuleDict({str(e): block.experts[e]
                                      for e in range(self.first, self.first + self.n_local)})
        # DeepSeek's experts every token runs: on every rank, replicated like the attention
        # (`is_expert_parameter` leaves `shared_experts` out)
        self.shared_experts = block.shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                   # [tokens, d]
        weights, chosen = choose(self, self.gate(flat))
        flat, weights = split_expert_inputs(flat, weights, self.tp_group)
        # One row per (token, slot), sorted by expert: rows for rank j are then contiguous.
        expert = chosen.reshape(-1)
        order = expert.argsort(stable=True)
        token = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.top_k)[order]
        send, recv, row_expert = self.splits(expert)
        rows = all_to_all(flat[token], recv, send, self.group)               # [received, d]
        out = run_experts(((int(e), m) for e, m in self.experts.items()), rows, row_expert)
        back = all_to_all(out, send, recv, self.group)                       # [tokens * k, d]
        back = back * weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add(0, token, back).view_as(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def splits(self, expert: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each ep rank, rows received from each, the local expert of each
        received row) for the routed rows' experts `expert` [tokens * k]: the counts are
        exchanged first, as the all-to-all of rows needs its split sizes."""
        send_counts = torch.bincount(expert, minlength=self.n_experts)       # [experts]
        recv_counts = torch.empty_like(send_counts)                          # [ep * n_local]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send = send_counts.view(self.ep, self.n_local).sum(1).tolist()
        recv = recv_counts.view(self.ep, self.n_local).sum(1).tolist()
        local = torch.arange(self.first, self.first + self.n_local, device=expert.device)
        return send, recv, local.repeat(self.ep).repeat_interleave(recv_counts)  # src-major


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's process groups for expert parallelism over the dp ranks of a mesh: `ep`,
    the ranks its experts are spread over; `replicas`, the ranks that own the same experts
    (None when ep = dp, one owner each)."""
    ep: dist.ProcessGroup
    replicas: dist.ProcessGroup | None

    @classmethod
    def of(cls, mesh: DeviceMesh, ep: int) -> "ExpertGroups":
        """The groups of `ep` consecutive dp ranks (a collective: every rank makes every
        group, in one order)."""
        dims = list(mesh.mesh_dim_names)
        ranks = mesh.mesh.movedim(dims.index("dp"), -1)
        rows = ranks.reshape(-1, ranks.shape[-1]).tolist()   # one row per dp group
        me = dist.get_rank()
        mine: dict[str, Any] = {"ep": None, "replicas": None}
        for row in rows:
            for kind, members in [("ep", row[i:i + ep]) for i in range(0, len(row), ep)] + (
                    [("replicas", row[i::ep]) for i in range(ep)] if ep < len(row) else []):
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
        return cls(mine["ep"], mine["replicas"])

    @torch.no_grad()
    def reduce(self, model: nn.Module) -> None:
        """Sum each routed expert's gradient over its replicas (no-op when ep = dp)."""
        if self.replicas is None:
            return
        for name, p in model.named_parameters():
            if is_expert_parameter(name):
                if p.grad is None:   # every replica must join every all-reduce
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.replicas)


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None
                          ) -> nn.Module:
    """Replace every `MoEBlock` of `model` (in place) by its expert-parallel shard; returns it."""
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise ValueError("expert parallelism needs an MoE model (n_experts > 0); set ep=1")
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, ExpertParallelMoE(block, group))
    return model


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter name belongs to a routed expert (sharded, not replicated, under ep)."""
    return ".experts." in name


@torch.no_grad()
def all_reduce_replicated_grads(model: nn.Module, group: dist.ProcessGroup | None = None
                                ) -> None:
    """Sum the gradients of all non-expert parameters over the ep group."""
    for name, p in model.named_parameters():
        if not is_expert_parameter(name):
            if p.grad is None:   # every rank must join every all-reduce
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)


def expert_modules(model: nn.Module) -> list[tuple[str, ExpertParallelMoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]


def scale_expert_grads(model: nn.Module, factor: float) -> None:
    """Multiply every routed expert's gradient by `factor` as it is computed (before it
    accumulates over micro-batches)."""
    for name, p in model.named_parameters():
        if is_expert_parameter(name):
            p.register_hook(lambda grad: grad * factor)


def all_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's routed experts as plain CPU tensors under the full model's names, on every
    rank of the ep group (a collective of the ep and tp groups; {} without expert
    parallelism)."""
    modules = expert_modules(model)
    if not modules:
        return {}
    own = {f"{name}.experts.{k}": whole(v).detach().to("cpu", copy=True)
           for name, m in modules for k, v in m.experts.state_dict().items()}
    group = modules[0][1].group
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, own, group=group)
    return {k: v for part in got for k, v in part.items()}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel expert weight gathered whole (a collective over its tp ranks)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
