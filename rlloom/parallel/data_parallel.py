"""Data parallelism with ZeRO stages 0-3, all on FSDP2's per-parameter DTensor machinery.

What each `Layout.zero` level maps to (over the `dp` mesh dimension):

- zero=0: FSDP2's `replicate` (the DTensor-based DDP): full parameters, gradients and
  optimizer state on every rank; gradients are all-reduced (averaged) during the step's
  last backward, layer by layer (`before_backward`: earlier micro-batches accumulate
  locally).
- zero=1: the same `replicate` for parameters and gradients, plus `Zero1AdamW`, whose Adam
  moments are partitioned parameter-by-parameter across dp ranks: each rank steps the
  parameters it owns and broadcasts them (the scheme of torch's `ZeroRedundancyOptimizer`,
  which cannot broadcast the DTensor parameters that `replicate` and TP produce).
- zero=2: `fully_shard(reshard_after_forward=False)` (FSDP's SHARD_GRAD_OP): gradients are
  reduce-scattered in every backward (they stay sharded) and the optimizer steps a 1/dp
  shard. Parameters are all-gathered once per step and kept unsharded from the first
  forward through the last backward (`before_backward`); between steps they rest sharded,
  so at rest this saves as much memory as ZeRO-3.
- zero=3: `fully_shard(reshard_after_forward=True)` (FULL_SHARD): parameters are freed after
  each layer's forward and all-gathered again for its backward. With `offload` the shards
  (parameters, gradients, hence the optimizer state and step) live in host memory; each
  layer's shard is copied to the device for its gather and its gradient shard copied back
  (FSDP2's `CPUOffloadPolicy`).

Every level averages gradients over dp ranks, as DDP does: if each rank's loss is the mean
over its own shard of a batch split evenly, the gradient is that of the global mean. For
token-normalised losses with uneven shards, scale each rank's loss by
`dp * local_tokens / global_tokens`.

Each decoder layer is its own communication group (wrapped before the root), so the
collectives of one layer overlap the computation of the next.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from rlloom.parallel.tensor_parallel import backbone_of

# Methods that stand in for forward() on rlloom models (hidden states for chunked heads,
# ActorCritic's values).
# Calling submodules directly (e.g. `critic.score(critic.model(x))`) bypasses the root's hooks
# and is wrong under data parallelism: call the model itself or one of these.
FORWARD_METHODS = ("hidden", "values")
# the ZeRO stage each data-parallel root was wrapped at (`before_backward` reads it)
_ZERO: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def mixed_precision_policy(device_type: str, enabled: bool | None = None
                           ) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction, where the device computes in bf16.

    `enabled=None` decides from the device: on CUDA with bf16 support it is on; on CPU it is
    off (fp32 throughout), because CPU bf16 matmuls are slow and change numerics.
    Master weights and optimizer state stay in the parameters' own dtype either way.
    """
    if enabled is None:
        enabled = device_type == "cuda" and torch.cuda.is_available() \
            and torch.cuda.is_bf16_supported()
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, zero: int,
                        mixed_precision: bool | None = None,
                        layers: Iterable[nn.Module] | None = None,
                        ignored: set[nn.Parameter] | None = None, offload: bool = False
                        ) -> nn.Module:
    """Make `model` data parallel over the 1-D `dp_mesh` at ZeRO stage `zero`, in place.

    Apply after tensor parallelism and activation checkpointing. ZeRO-1 also needs the
    optimizer from `rlloom.parallel.apply.make_optimizer`. `layers`: the decoder layers to
    wrap one by one (default: the backbone's; a pipeline stage passes its own). `ignored`:
    parameters left whole and unreduced (routed experts, which differ between ranks).
    `offload`: ZeRO-3's shards rest in host memory (see the module's docstring).
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, not {zero}")
    if offload and zero != 3:
        raise ValueError(f"offload needs zero=3 (its shards are what moves to host memory), "
                         f"not zero={zero}")
    mp_policy = mixed_precision_policy(dp_mesh.device_type, mixed_precision)
    # pinned host memory makes the copies asynchronous; it needs an accelerator
    policy = (CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if offload
              else OffloadPolicy())
    if zero <= 1:
        def wrap(module: nn.Module, last: bool) -> None:
            replicate(module, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
    else:
        def wrap(module: nn.Module, last: bool) -> None:
            # The root stays unsharded after forward in any case: its backward comes first.
            fully_shard(module, mesh=dp_mesh, mp_policy=mp_policy,
                        reshard_after_forward=zero == 3 and not last, ignored_params=ignored,
                        offload_policy=policy)
    for layer in layers if layers is not None else backbone_of(model).layers:
        wrap(layer, last=False)
    wrap(model, last=True)
    # The root's hooks (gather the root's parameters, reduce their gradients) run around
    # forward() only; other entry points that use the root's parameters must be registered.
    for method in FORWARD_METHODS:
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    _ZERO[model] = zero
    return model


def before_backward(model: nn.Module, last: bool) -> None:
    """Call before each backward of an optimizer step that runs several (one per
    micro-batch); `last` for the step's final one. Replicas (ZeRO 0/1) then all-reduce
    gradients once a step, in the last backward, accumulating locally before; ZeRO-2 keeps
    its gathered parameters until the last backward, so they are gathered once a step
    (its gradients are reduce-scattered in every backward, to stay sharded). ZeRO-3
    gathers and frees per pass, as it shards to save memory. A no-op without dp."""
    zero = _ZERO.get(model)
    if zero is None:
        return
    if zero <= 1 and isinstance(model, ReplicateModule):
        model.set_requires_gradient_sync(last)
    elif zero == 2 and isinstance(model, FSDPModule):
        model.set_reshard_after_backward(last)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    # Under no_grad, a DTensor's to_local() is its storage, so writes reach the parameter.
    return p.to_local() if hasattr(p, "to_local") else p


class Zero1AdamW(torch.optim.AdamW):
    """AdamW with its state partitioned over the ranks of `dp_group` (ZeRO-1).

    Each parameter is owned by one dp rank (whole parameters, largest first to the least
    loaded rank), so a rank holds Adam moments for about 1/dp of the model. `step()` updates
    the owned parameters from their (all-reduced) gradients, then every rank broadcasts what
    it owns, one flat buffer per rank and dtype. Works on plain and DTensor parameters (under
    TP a dp group shares one TP coordinate, so the local shards line up). The optimizer's
    `param_groups` and `state_dict()` cover only the owned parameters; DCP sharded
    checkpoints (`rlloom.parallel.apply.save_sharded`) therefore hold each state once, and
    load into any layout. `own`: parameters that differ between the dp ranks (routed
    experts under expert parallelism): each rank steps its own and broadcasts none.
    """

    def __init__(self, params: Iterable[torch.Tensor], dp_group: dist.ProcessGroup,
                 own: Iterable[torch.Tensor] = (), **adamw: Any) -> None:
        own = list(own)
        params = [p for p in params if all(p is not q for q in own)]
        world, me = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        if len(params) < world:
            raise ValueError(f"ZeRO-1 over {world} ranks needs at least {world} parameters, "
                             f"got {len(params)}")
        load = [0] * world
        owner = {}
        for i in sorted(range(len(params)), key=lambda i: -local_tensor(params[i]).numel()):
            r = min(range(world), key=load.__getitem__)
            owner[i] = r
            load[r] += local_tensor(params[i]).numel()
        super().__init__([p for i, p in enumerate(params) if owner[i] == me] + own, **adamw)
        self.all_params = params + own
        self.owners = [owner[i] for i in range(len(params))] + [-1] * len(own)  # -1: no one
        self.dp_group = dp_group

    @torch.no_grad()
    def _broadcast_owned(self) -> None:
        for r in range(dist.get_world_size(self.dp_group)):
            src = dist.get_global_rank(self.dp_group, r)
            mine = [local_tensor(p) for p, o in zip(self.all_params, self.owners) if o == r]
            for dtype in sorted({t.dtype for t in mine}, key=str):
                ts = [t for t in mine if t.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.broadcast(flat, src=src, group=self.dp_group)
                if dist.get_rank(self.dp_group) != r:
                    for t, part in zip(ts, flat.split([t.numel() for t in ts])):
                        t.copy_(part.view_as(t))

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self._broadcast_owned()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients land on every parameter, owned or not.
        for p in self.all_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
