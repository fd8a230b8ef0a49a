"""Gradient norms and clipping over parameters that mix DTensors (tensor- or data-parallel
shards) and plain tensors, as the parallel layouts leave them."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the parameters' gradients; each DTensor's norm is reduced over its own
    mesh, so every rank of a layout gets the whole model's norm (0 when none has one)."""
    norms = []
    for p in params:
        if p.grad is not None:
            n = torch.linalg.vector_norm(p.grad, 2.0)
            if isinstance(n, DTensor):
                if n.device.type != n.device_mesh.device_type:
                    # an offloaded shard's gradient is in host memory; NCCL reduces device
                    # tensors only
                    n = DTensor.from_local(n.to_local().to(n.device_mesh.device_type),
                                           n.device_mesh, n.placements)
                n = n.full_tensor()
            norms.append(n)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


@torch.no_grad()
def scale_grads(params: Iterable[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients so that a total norm `total` becomes at most `max_norm` (the eps
    and clamp of `torch.nn.utils.clip_grad_norm_`)."""
    coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   disjoint: Iterable[torch.Tensor] = (), group: Any = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a mix of DTensor and plain parameters; returns the
    total norm. `disjoint`: parameters of which each rank of process group `group` holds
    different ones (routed experts): their squared norms are summed over the group."""
    params, disjoint = list(params), list(disjoint)
    total = squared_norm(params, disjoint, group).sqrt()
    scale_grads(params + disjoint, total, max_norm)
    return total


def squared_norm(params: Iterable[torch.Tensor], disjoint: Iterable[torch.Tensor] = (),
                 group: Any = None) -> torch.Tensor:
    """The squared 2-norm of the gradients of `params` and of `disjoint`, parameters of which
    each rank of process group `group` holds different ones (their squares summed over it;
    a collective when any are given)."""
    squares = grad_norm(params) ** 2
    disjoint = list(disjoint)
    if disjoint:
        theirs = grad_norm(disjoint) ** 2
        dist.all_reduce(theirs, group=group)
        squares = squares + theirs
    return squares
