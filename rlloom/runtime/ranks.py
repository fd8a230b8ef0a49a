"""One device group's ranks as one torch.distributed world, and the collectives the RL stages
need inside it. The single process is the one-rank case: every collective is the identity.

A group of N ranks (Ray actors, or the processes torchrun started) joins one world (NCCL on
GPUs, gloo on CPUs). Each model on the group uses all N ranks in its own `Layout`, so one
world holds a mesh per layout. Data flow inside a group:
  generation  each data-parallel replica of the generation layout samples its contiguous
              share of the step's prompts (TP ranks sample identically: same seed, same
              logits); the shares are all-gathered, so every rank holds the whole batch;
  assessment  each replica of a scoring model's layout scores its share of the rows; the
              scores are all-gathered and advantages computed over the whole batch, as one
              process computes them;
  training    every rank holds the whole batch and trains on its replica's share of each
              mini-batch, with the loss normalisers of the whole mini-batch divided by dp
              (data parallelism averages the replicas' gradients), so the averaged gradient is
              the one-process gradient of the same mini-batch.
"""
from __future__ import annotations

import gc
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from rlloom.parallel.apply import make_optimizer, parallelize, parallelize_pipeline
from rlloom.parallel.context_parallel import apply_context_parallel
from rlloom.parallel.data_parallel import apply_data_parallel, local_tensor
from rlloom.parallel.expert_parallel import ExpertGroups, all_experts, is_expert_parameter
from rlloom.parallel.grads import clip_grad_norm
from rlloom.parallel.mesh import build_mesh, validate_layout
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.parallel.tensor_parallel import apply_tensor_parallel, backbone_of
from rlloom.plan import Layout


def free_address(host: str) -> str:
    """tcp://HOST:PORT with a port free on this machine, for a rendezvous; `host` is the
    address other machines reach this one at (a hostname may resolve to 127.0.0.1, so it is
    not derived from one)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class Share:
    """This rank's part of the work of one layout: its data-parallel replica `part` of
    `parts`, whether it leads the replica (TP/CP ranks of a replica hold copies), and the cp
    group whose ranks each hold a sequence shard of the replica's rows. (TP, CP and PP ranks
    of a replica hold copies of its results: one leads.)"""
    parts: int = 1
    part: int = 0
    leader: bool = True
    context: Any = None  # torch.distributed ProcessGroup of the cp ranks, None without cp
    experts: ExpertGroups | None = None  # the routed experts' groups, None without ep

    def clip_grad_norm(self, model: nn.Module | PipelinedModel, max_norm: float
                       ) -> torch.Tensor:
        """Clip `model`'s gradients by the whole model's norm (a pipeline's: every stage's);
        each rank's routed experts are its own, so their squares are summed over the ep
        group."""
        if isinstance(model, PipelinedModel):
            return model.clip_grad_norm(max_norm, self.experts.ep if self.experts else None)
        if self.experts is None:
            return clip_grad_norm(model.parameters(), max_norm)
        named = list(model.named_parameters())
        return clip_grad_norm([p for n, p in named if not is_expert_parameter(n)], max_norm,
                              disjoint=[p for n, p in named if is_expert_parameter(n)],
                              group=self.experts.ep)

    def reduce(self, model: nn.Module) -> None:
        """Finish `model`'s gradients after a backward: sum each routed expert's over its
        replicas (ep below dp) and average every gradient over the cp group: each cp rank
        computed the loss on outputs gathered from every shard (`context_parallel.on_shards`),
        so its gradients are cp times its shard's part of the whole."""
        if self.experts is not None:
            self.experts.reduce(model)
        if self.context is None:
            return
        cp = dist.get_world_size(self.context)
        for p in model.parameters():
            if p.grad is not None:
                grad = local_tensor(p.grad)
                dist.all_reduce(grad, group=self.context)  # gloo has no AVG
                grad.div_(cp)

    def of(self, n: int) -> slice:
        """The replica's contiguous share of n items (the first n % parts replicas get one
        more)."""
        base, extra = divmod(n, self.parts)
        start = self.part * base + min(self.part, extra)
        return slice(start, start + base + (self.part < extra))

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The replica's share of the rows `idx`."""
        return idx[self.of(len(idx))]


@dataclass
class RankGroup:
    """This process's place in its group: rank, world size, device, and a mesh per layout."""
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _meshes: dict[tuple, DeviceMesh] = field(default_factory=dict)
    _experts: dict[tuple, ExpertGroups] = field(default_factory=dict)

    @classmethod
    def join(cls, device: torch.device, rank: int = 0, world: int = 1,
             address: str | None = None, timeout_s: float = 600.0) -> "RankGroup":
        """Join a world of `world` ranks at `address` (torchrun's environment when None);
        one rank joins nothing."""
        if world > 1 and not dist.is_initialized():
            if device.type == "cuda":  # NCCL (and object collectives) run on the current device
                torch.cuda.set_device(device)
            kwargs = {} if address is None else {"init_method": address, "rank": rank,
                                                  "world_size": world}
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=timeout_s), **kwargs)
        if world > 1:
            rank, world = dist.get_rank(), dist.get_world_size()
        return cls(rank, world, device)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mesh(self, layout: Layout) -> DeviceMesh | None:
        """The mesh of `layout` over this group's ranks (None for one rank)."""
        if self.world == 1:
            return None
        key = tuple(getattr(layout, d) for d in ("pp", "dp", "cp", "tp"))
        if key not in self._meshes:
            self._meshes[key] = build_mesh(layout, self.device.type)
        return self._meshes[key]

    def share(self, layout: Layout) -> Share:
        mesh = self.mesh(layout)
        if mesh is None:
            return Share()
        return Share(mesh["dp"].size(), mesh["dp"].get_local_rank(),
                     all(mesh[d].get_local_rank() == 0 for d in ("pp", "cp", "tp")),
                     mesh["cp"].get_group() if layout.cp > 1 else None,
                     self.experts(layout))

    def experts(self, layout: Layout) -> ExpertGroups | None:
        """The expert-parallel groups of `layout` (None without ep), made once per layout."""
        if layout.ep == 1 or self.world == 1:
            return None
        key = (tuple(getattr(layout, d) for d in ("pp", "dp", "cp", "tp")), layout.ep)
        if key not in self._experts:
            self._experts[key] = ExpertGroups.of(self.mesh(layout), layout.ep)
        return self._experts[key]

    # -- collectives (identities for one rank) -------------------------------------------------
    def most(self, n: int) -> int:
        """The largest of the ranks' n: how many micro-batches every rank runs, so that their
        passes, and the collectives inside them, pair up."""
        if self.world == 1:
            return n
        count = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def agree(self) -> Any:
        """`packing.Agree` for this group: None for one rank (no other rank to pair up with)."""
        return self.most if self.world > 1 else None

    def mean(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Scalar metrics averaged over ranks (each rank's are already the whole batch's
        divided by dp, see the module docstring, so the mean over replicas is the total)."""
        if self.world == 1:
            return stats
        keys = sorted(k for k, v in stats.items() if isinstance(v, (int, float)))
        values = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values)
        return {**stats, **{k: v / self.world for k, v in zip(keys, values.tolist())}}

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (pickled; move tensors to the CPU first: a
        pickled CUDA tensor unpickles on the sender's GPU index)."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sampling_state(self, generator: torch.Generator) -> dict[str, Any]:
        """The sampling RNG for a checkpoint: this rank's (rank 0's is the one written), and
        with several ranks every rank's, since each generation replica has its own stream
        (a collective)."""
        own = generator.get_state()
        return {"sample_gen": own, **({"sample_gens": self.gather(own)} if self.world > 1
                                      else {})}

    def load_sampling_state(self, generator: torch.Generator, state: dict[str, Any]) -> None:
        """Each rank's own stream when the checkpoint has one per rank of a group this size;
        else rank 0 takes the written one and other ranks keep their seeds' (a resume at
        another layout samples anew there)."""
        streams = state.get("sample_gens")
        if streams is not None and len(streams) == self.world:
            generator.set_state(streams[self.rank])
        elif self.rank == 0:
            generator.set_state(state["sample_gen"])

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # -- models ----------------------------------------------------------------------------
    def trained(self, model: nn.Module, layout: Layout, lr: float,
                compute: torch.dtype | None = None, **adamw: Any
                ) -> tuple[nn.Module | PipelinedModel, torch.optim.Optimizer]:
        """Apply `layout` to a model that trains here: what trains (the model itself, or with
        pp > 1 this rank's pipeline stage of it) and its optimizer (ZeRO-sharded when the
        layout says so). `compute`: the stages' autocast dtype (`device.compute_dtype`);
        data parallelism then gathers the weights in it and reduces gradients in fp32, so
        no layer keeps an autocast copy of its weights through backward (2 B per parameter
        of the whole model under ZeRO-3, which frees the gathered weights per layer)."""
        mesh = self.mesh(layout)
        if layout.pp > 1:
            pipe = parallelize_pipeline(model, layout, mesh, experts=self.experts(layout),
                                        mixed_precision=compute == torch.bfloat16)
            return pipe, make_optimizer(pipe.module, layout, mesh, lr, **adamw)
        # one rank applies its layout too: activation checkpointing is its to apply
        parallelize(model, layout, mesh, mixed_precision=compute == torch.bfloat16,
                    experts=self.experts(layout))
        return model, make_optimizer(model, layout, mesh, lr, **adamw)

    def generating(self, model: nn.Module, layout: Layout) -> nn.Module:
        """A model that only generates, in `layout`: TP shards it; each data-parallel replica
        holds a whole copy and samples its own prompts, so no DP wrapper (ZeRO-3 gathers of
        replicas that decode for different numbers of steps would deadlock)."""
        mesh = self.mesh(layout)
        if mesh is not None:
            validate_layout(layout, backbone_of(model).config, self.world)
            if layout.tp > 1:
                apply_tensor_parallel(model, mesh["tp"])
        return model
    def frozen(self, model: nn.Module, layout: Layout) -> nn.Module | PipelinedModel:
        """A forward-only model in `layout`: CP runs it on sequence shards, TP shards it, PP
        splits it into this rank's stage (scored with a forward-only pipeline schedule),
        ZeRO-3 shards it over dp (gathered per layer as it runs); plain dp keeps a whole copy
        per replica (no gradients, so no wrapper)."""
        mesh = self.mesh(layout)
        if mesh is None:
            return model
        validate_layout(layout, backbone_of(model).config, self.world)
        if layout.pp > 1:
            return parallelize_pipeline(model, layout, mesh, trains=False)
        if layout.cp > 1:
            apply_context_parallel(model, mesh["cp"].get_group())
        if layout.tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        if layout.dp > 1 and layout.zero == 3:
            apply_data_parallel(model, mesh["dp"], 3, mixed_precision=False,
                                offload=layout.offload)
        return model

    def full_state(self, model: nn.Module | PipelinedModel) -> dict[str, torch.Tensor]:
        """The model's whole weights as plain CPU tensors on rank 0 ({} elsewhere); every rank
        must call it."""
        if self.world == 1:
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        state = whole_weights(model, cpu=True)
        return state if self.main else {}


def whole_weights(model: nn.Module | PipelinedModel, cpu: bool = False
                  ) -> dict[str, torch.Tensor]:
    """The unsharded weights under the plain model's names, on every rank (a collective
    of the model's layout; a pipeline's stages each contribute theirs)."""
    if isinstance(model, PipelinedModel):
        return model.full_state()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=cpu))
    experts = all_experts(model)  # each rank holds its own; cpu_offload leaves {} off rank 0
    return {**state, **experts} if state else state


def leave_world() -> None:
    """Destroy the process group, if one was joined, while the interpreter is still whole:
    left to interpreter teardown, gloo's worker threads may release tensors after Python is
    gone and abort the process (SIGABRT) at random, after a run that succeeded. Callers drop
    their models first: what is collected here, FSDP2 states and meshes, is freed while the
    groups it references still exist (a kept Ray rank closed in the other order was seen to
    abort on a corrupt heap, "malloc(): unaligned tcache chunk detected", in its next run)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Empty DTensor's memo tables, which key device meshes by value (layout and dimension
    names, not their process groups): a process that joins another world (a rank kept for the
    next group, `ray/pool.py`) would otherwise get back the last world's mesh for an equal one
    and run its collectives on groups that are gone, or on other ranks' groups by the same
    name. Private torch functions: pinned torch (2.13); a rename fails here, loudly."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug
    debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def reshard(trained: nn.Module | PipelinedModel, copy: nn.Module) -> tuple[float, float]:
    """Copy the trained weights into another layout's copy on the same ranks (collective);
    (seconds, bytes this rank received into its copy's shards)."""
    t0 = time.perf_counter()
    set_model_state_dict(copy, whole_weights(trained),
                         options=StateDictOptions(full_state_dict=True))
    nbytes = sum(local_tensor(p).numel() * p.element_size() for p in copy.parameters())
    return time.perf_counter() - t0, float(nbytes)
