"""One process's place in a `torchrun` world: the actor's training and generation meshes, how
a step's batch is split across them, and the collectives the RL loop needs between stages.

Data flow of one step (every rank draws the same prompts from the same seeded stream):
  generation  each data-parallel replica of the generation layout samples its contiguous
              share of the prompts (its TP ranks sample identically: same seed, same logits);
  gather      the replicas' Samples are all-gathered (pickled over the process group), so
              every rank holds the whole batch;
  training    each data-parallel rank of the training layout assesses and trains on its
              contiguous share of whole groups, with loss normalisers summed over the
              training dp group, so the gradient equals the one-process gradient.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
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

from rlloom.config import ConfigError, RunConfig
from rlloom.models.hf_io import replace_dir
from rlloom.parallel.apply import load_sharded, save_sharded
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout
from rlloom.rollout.generate import cat_rollouts
from rlloom.runtime.checkpoint import checkpoint_dirs
from rlloom.runtime.device import torchrun_device
from rlloom.runtime.online import Samples


def world_size() -> int:
    """Processes `torchrun` started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def distributed_problems(cfg: RunConfig, world: int) -> list[str]:
    """Why this plan cannot run in a `torchrun` world of `world` processes (empty when it can).
    Placement and schedule across roles are the Ray runtime's; here every role shares the
    world, the actor with its training layout and optionally a "rollout" generation layout."""
    plan, problems = cfg.plan, []
    if plan.placement != "colocated" or plan.schedule != "sync":
        problems.append(f"plan.placement={plan.placement}, plan.schedule={plan.schedule}: "
                        "torchrun runs colocated/sync plans (use the Ray runtime for others)")
    for role in ("actor", "rollout"):
        layout = plan.layouts.get(role)
        if layout is None and role == "rollout":
            continue
        layout = layout or Layout()
        if layout.world_size != world:
            problems.append(f"plan.layouts.{role} uses {layout.world_size} processes but "
                            f"torchrun started {world}; make dp x tp x pp x cp = {world}")
        for dim in ("pp", "cp", "ep"):
            if getattr(layout, dim) > 1:
                problems.append(f"plan.layouts.{role}.{dim}={getattr(layout, dim)}: the trainer "
                                "applies dp (zero 0-3) and tp; set it to 1")
    for role in ("reference", "critic", "reward"):
        if role in plan.layouts:
            problems.append(f"plan.layouts.{role}: under torchrun the {role} follows the actor's "
                            "layout (forward-only roles keep zero 0); remove the entry")
    if plan.actor_critic == "shared" and world > 1:
        problems.append("plan.actor_critic=shared is single-process only; use separate")
    if cfg.algo.dynamic_sampling and world > 1:
        problems.append("algo.dynamic_sampling is single-process only")
    if cfg.rollout.stop and world > 1:
        problems.append("rollout.stop needs the generation engine's fast path, which runs only "
                        "unsharded models; remove rollout.stop or run in one process")
    return problems


def join_process_group(requested: str) -> torch.device:
    """Join the process group torchrun set up and return this process's device (for
    `train.device=requested`): NCCL on cuda:LOCAL_RANK, made the current CUDA device because
    NCCL collectives (and object collectives) run on it, or gloo on the CPU."""
    device = torchrun_device(requested)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def leave_process_group() -> None:
    """Destroy the process group, if one was joined, while the interpreter is still whole:
    left to interpreter teardown, gloo's worker threads may release tensors after Python is
    gone and abort the process (SIGABRT) at random, after a run that succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Collective:
    """The meshes of this rank and the collectives between stages."""
    rank: int
    world: int
    train: Layout
    gen: Layout
    train_mesh: DeviceMesh
    gen_mesh: DeviceMesh
    device: torch.device  # this rank's: cuda:LOCAL_RANK under NCCL, else the CPU
    # Generation runs on its own copy of the actor (TP only, never a DP wrapper) when the
    # plan gives a "rollout" layout or the actor trains data-parallel: data-parallel replicas
    # generate different prompts for different numbers of steps, so their forward passes must
    # not need each other (ZeRO-3 gathers would deadlock). Weights are resharded into it.
    gen_copy: bool

    @classmethod
    def start(cls, cfg: RunConfig) -> "Collective":
        """This rank's meshes for the plan's actor layouts."""
        problems = distributed_problems(cfg, world_size())
        if problems:
            raise ConfigError("this plan cannot run under torchrun: " + "; ".join(problems))
        device = join_process_group(cfg.train.device)
        train = cfg.plan.layout("actor")
        hybrid = "rollout" in cfg.plan.layouts
        gen = cfg.plan.layouts["rollout"] if hybrid else train
        train_mesh = build_mesh(train, device.type)
        return cls(dist.get_rank(), dist.get_world_size(), train, gen, train_mesh,
                   build_mesh(gen, device.type) if hybrid else train_mesh, device,
                   hybrid or train.dp > 1)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, n: int, mesh: DeviceMesh) -> slice:
        """This rank's contiguous share of n items over the mesh's dp dimension."""
        parts, part = mesh["dp"].size(), mesh["dp"].get_local_rank()
        if n % parts:
            raise ConfigError(f"{n} items do not split over dp={parts}; make train."
                              f"prompts_per_step a multiple of every dp degree")
        size = n // parts
        return slice(part * size, (part + 1) * size)

    def gather(self, samples: Samples, pad_id: int) -> Samples:
        """Every generation replica's Samples, concatenated in replica order, on every rank
        (on its device)."""
        parts: list[Samples | None] = [None] * self.world
        leader = self.gen_mesh["tp"].get_local_rank() == 0  # TP ranks hold copies
        # pickled CUDA tensors would unpickle on the sender's GPU index, not the receiver's
        dist.all_gather_object(parts, samples.to("cpu") if leader else None)
        got = [s for s in parts if s is not None]
        offsets, problems = [], []
        for s in got:
            offsets.append(len(problems))
            problems += s.problems
        return Samples(problems, cat_rollouts([s.rollout for s in got], pad_id),
                       torch.cat([s.group_ids + o for s, o in zip(got, offsets)]),
                       {k: torch.cat([s.terms[k] for s in got]) for k in got[0].terms},
                       torch.cat([s.scores for s in got]), 1,
                       max(s.score_s for s in got)).to(self.device)

    def training_share(self, samples: Samples) -> tuple[Samples, torch.Tensor]:
        """The whole groups this rank's training dp replica assesses and trains on, and their
        rows in `samples`."""
        groups = self.share(len(samples.problems), self.train_mesh)
        rows = (samples.group_ids >= groups.start) & (samples.group_ids < groups.stop)
        idx = rows.nonzero().squeeze(1)
        return Samples(samples.problems[groups], samples.rollout.select(idx),
                       samples.group_ids[idx] - groups.start,
                       {k: v[idx] for k, v in samples.terms.items()}, samples.scores[idx],
                       samples.rounds, samples.score_s), idx

    def global_counts(self, tokens: float, seqs: float) -> tuple[float, float]:
        """Token and sequence counts of the whole mini-batch (summed over the training dp
        replicas; TP ranks hold the same rows), divided by dp: data parallelism averages the
        replicas' gradients, and every aggregation divides by exactly one of tokens or seqs,
        so normalising by these makes the averaged gradient the one-process gradient of the
        whole mini-batch. Every rank gets the same counts, so all skip an empty one alike."""
        if self.train.dp == 1:
            return tokens, seqs
        counts = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.train_mesh["dp"].get_group())
        return float(counts[0]) / self.train.dp, float(counts[1]) / self.train.dp

    def most(self, n: int) -> int:
        """The largest of the ranks' n: how many micro-batches every rank runs, so that their
        passes, and the collectives inside them, pair up."""
        count = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def mean(self, stats: dict[str, float]) -> dict[str, float]:
        """Scalar metrics averaged over ranks (equal-sized shares, so the mean of means)."""
        keys = sorted(k for k, v in stats.items() if isinstance(v, (int, float)))
        values = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values)
        return {**stats, **{k: v / self.world for k, v in zip(keys, values.tolist())}}

    def reshard(self, trained: nn.Module, generator: nn.Module) -> tuple[float, float]:
        """Copy the trained weights into the generation copy's layout; (seconds, bytes this
        rank received into its generation shards)."""
        t0 = time.perf_counter()
        full = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True))
        set_model_state_dict(generator, full, options=StateDictOptions(full_state_dict=True))
        nbytes = sum(_local(p).numel() * p.element_size() for p in generator.parameters())
        return time.perf_counter() - t0, float(nbytes)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def save_sharded_checkpoint(coll: Collective, run_dir: Path, step: int, state: dict[str, Any],
                            parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
                            keep: int) -> None:
    """checkpoints/step_NNNNNN with each model's DCP shards under its name and the loop state
    (step, RNG, data position) in state.pt; renamed into place only when complete."""
    root = run_dir / "checkpoints"
    tmp, final = root / f".tmp_step_{step:06d}", root / f"step_{step:06d}"
    if coll.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    for name, (model, optim) in parts.items():
        save_sharded(model, optim, tmp / name)
    if coll.main:
        torch.save(state, tmp / "state.pt")
        replace_dir(tmp, final)
        for old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()


def load_sharded_checkpoint(run_dir: Path,
                            parts: dict[str, tuple[nn.Module, torch.optim.Optimizer]]
                            ) -> dict[str, Any] | None:
    """The latest checkpoint's loop state, after loading every model's shards at this run's
    layout (which may differ from the one that saved them)."""
    dirs = checkpoint_dirs(run_dir)
    if not dirs:
        return None
    latest = dirs[-1]
    if not (latest / "actor").is_dir():
        raise ConfigError(f"{latest} was written by a single-process run; resume it without "
                          "torchrun (sharded and single-process checkpoints do not mix yet)")
    for name, (model, optim) in parts.items():
        load_sharded(model, optim, latest / name)
    return torch.load(latest / "state.pt", map_location="cpu", weights_only=False)
