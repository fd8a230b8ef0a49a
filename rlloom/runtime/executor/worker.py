"""One rank of a device group, hosting the stages its group runs: a Ray actor, or this process
(and each of its torchrun peers) in `local.py`.

A `GroupWorker` is one rank of a device group (`plan.device_groups`); the group's ranks form
one torch.distributed world (`ranks.RankGroup`: NCCL on GPUs, gloo on CPUs) and every model
on the group uses all of them in its own layout. A worker hosts the stages its group runs:

- generation: the actor's sampling copy, the prompt stream, the sampling RNG and the rewarder
  (rule verifier, sandbox pool, reward model: rewards are scored as samples finish, as in
  the single-process runtime, because dynamic sampling needs them);
- assessment: the frozen reference and, for PPO, the critic (the trainer's own, or a copy
  refreshed by weight sync when the group does not train);
- training: the policy, the critic, their optimizers and the shuffling RNG; held-out
  evaluation runs here because the newest weights live here.

Each stage runs the functions of `generation.py` and `online.py` (`generate_group`, `assess`,
`optimise`) on the group's ranks. The step loop (`loop.py`) calls every rank of a group with
the same arguments and reads rank 0's answer (on Ray), or each rank reads its own (`spmd`: every
process of a torchrun world runs the loop). Stages in one group share one model object
instead of a synced copy: generation of a colocated or interleaved group reads the trainer's
live weights (or, when the actor generates in another layout or trains data-parallel, a copy
resharded after each step).

This module imports no Ray: the Ray executor (`ray/executor.py`) wraps `GroupWorker` as an
actor and picks each call's concurrency group ("control" for pings, spans and weight pushes,
which must answer while a stage runs on the default thread; they issue no collectives).
"""
from __future__ import annotations

import gc
import os
import socket
from pathlib import Path
from typing import Any

import torch

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.models.lora import has_lora, trained_state
from rlloom.plan import DeviceGroup
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rewards.tasks import sandbox_pool
from rlloom.runtime.executor.hosts import (
    AssessmentHost,
    Batch,
    GenerationHost,
    PreferenceHost,
    TrainingHost,
    copy_dtype,
)
from rlloom.runtime.executor.ray.files import localise
from rlloom.runtime.executor.weight_channel import WeightChannel
from rlloom.runtime.executor.weight_sync import SyncStats
from rlloom.runtime.outputs.spans import SpanLog
from rlloom.runtime.ranks import RankGroup, free_address, leave_world
from rlloom.runtime.stages.experience import Experience

# the attribute of GroupWorker holding each stage host
HOST_ATTRIBUTES = {"TrainingHost": "training", "GenerationHost": "generation",
                   "AssessmentHost": "assessment", "PreferenceHost": "preferences"}


def node_ip() -> str:
    """The address other nodes reach this process's node at: Ray's node IP in a Ray worker,
    else this machine alone."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def use_node_interface() -> None:
    """Point gloo and NCCL at the network interface holding this node's IP, unless the user
    chose one: by default they bind to what the hostname resolves to, on many machines
    127.0.0.1, which no other node reaches."""
    ip = node_ip()
    if ip.startswith("127."):
        return
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
            return


# -- the process ----------------------------------------------------------------------------

class GroupWorker:
    """One rank of a device group, hosting the stages its group runs. Constructed light;
    `start` joins the group's world and builds the models (every rank at once); `close`
    leaves it, and a process kept for another group (`ray/pool.py`) is `bind`-ed anew."""

    def __init__(self, cfg: RunConfig, model_path: str, group: DeviceGroup, rank: int,
                 threads: int, device: str, spmd: bool = False,
                 files: dict[str, tuple[str, Any]] | None = None) -> None:
        self.bind(cfg, model_path, group, rank, threads, device, spmd, files)

    def bind(self, cfg: RunConfig, model_path: str, group: DeviceGroup, rank: int,
             threads: int, device: str, spmd: bool = False,
             files: dict[str, tuple[str, Any]] | None = None) -> None:
        """Be rank `rank` of `group` in the run `cfg` (nothing built until `start`)."""
        # The process is this rank's alone: what is alive before a run (its imports, what
        # earlier runs imported) lives as long as the process, so the cyclic collector stops
        # walking it (~0.2 CPU-s a full collection with torch and transformers loaded, several
        # per run). What the run builds stays collectable: `leave_world` frees it in `close`.
        gc.freeze()
        torch.set_num_threads(threads)
        use_node_interface()
        if files:  # the driver's inputs this node lacks, shipped (ray/files.py)
            cfg, model_path = localise(cfg, model_path, files)
        self.cfg, self.path, self.group, self.rank = cfg, Path(model_path), group, rank
        self.spmd = spmd
        self.device = torch.device(device)
        # one rank speaks for the group in the trace
        self.spans = SpanLog(group.name, keep=rank == 0)
        self.pool: SandboxPool | None = None
        self.training: TrainingHost | None = None
        self.generation: GenerationHost | None = None
        self.assessment: AssessmentHost | None = None
        self.preferences: PreferenceHost | None = None
        self.channels: dict[str, WeightChannel] = {}  # weight sync: "policy", "critic"

    def address(self) -> str:
        """Where the group's ranks meet (asked of rank 0, whose node it is)."""
        return free_address(node_ip())

    def start(self, address: str | None, timeout_s: float) -> dict[str, Any]:
        cfg, group = self.cfg, self.group
        self.ranks = RankGroup.join(self.device, self.rank, group.ranks, address, timeout_s)
        needs_pool = cfg.data.task == "code" and (group.runs("generation")
                                                  or group.runs("training"))
        self.pool = sandbox_pool(cfg.reward) if needs_pool else None
        online = PRESETS[cfg.algo.name].online
        if group.runs("training"):
            self.training = TrainingHost(cfg, self.path, self.spans, self.pool, self.ranks,
                                         online and group.runs("generation"))
        if group.runs("generation") and online:
            self.generation = GenerationHost(cfg, self.path, self.spans, self.pool, self.ranks,
                                             self.training)
        if group.runs("assessment"):
            self.assessment = AssessmentHost(cfg, self.path, self.spans, self.ranks, group,
                                             self.training)
        if not online:
            self.preferences = PreferenceHost(cfg, self.spans, self.training, self.assessment)
        return self.ping()

    # control calls (answered while a stage runs; no collectives)
    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "group": self.group.name,
                "rank": self.rank}

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def open_channel(self, what: str, address: str, rank: int, world: int,
                     timeout_s: float) -> None:
        """Join the channel that carries `what` ("policy" or "critic") from the training
        group's rank 0 (channel rank 0) to the ranks of a group holding a copy."""
        self.channels[what] = WeightChannel(address, rank, world, self.device, timeout_s)

    def receive_weights(self, what: str, step: int, version: int, timeout_s: float
                        ) -> dict[str, float]:
        """Receive the trainer's `what` over its channel into the copy's free buffer (a control
        call: it runs while generation or assessment reads the other buffer)."""
        shadow = self.generation.weights if what == "policy" else self.assessment.critic
        with self.spans.span("weight_sync", step, "sync", what=what, version=version):
            state, nbytes = self.channels[what].receive(shadow.synced)
            stats: SyncStats = shadow.publish(version, state, timeout_s)
        return {"bytes": nbytes, "seconds": stats.seconds, "wait_s": stats.wait_s}

    # stage calls (default thread, in submission order; every rank of the group alike)
    def run(self, method: str, *args: Any) -> Any:
        """A stage host's method on this rank, by qualified name ("TrainingHost.train"): what
        `Group.call(TrainingHost.train, ...)` runs (`interface.routed`)."""
        owner, name = method.split(".")
        return getattr(getattr(self, HOST_ATTRIBUTES[owner]), name)(*args)

    # (rank 0 returns the batch or experience every rank computed; the driver reads rank 0's)
    def generate(self, step: int, prompts: int | None = None) -> tuple[Batch | None, dict]:
        batch, info = self.generation.generate(step, prompts)
        return self._lead(batch), info

    def assess(self, step: int, batch: Batch, kl_coef: float) -> tuple[Experience | None, dict]:
        exp, info = self.assessment.assess(step, batch, kl_coef)
        return self._lead(exp), info

    def finish_assessment(self, step: int, kl_coef: float, *chunks: int
                          ) -> tuple[Experience | None, dict]:
        exp, info = self.assessment.finish(step, kl_coef)
        return self._lead(exp), info

    def _lead(self, result: Any) -> Any:
        return result if self.ranks.main or self.spmd else None

    def evaluate(self, step: int) -> dict[str, float] | None:
        if self.preferences is not None and self.preferences.eval_pairs:
            return self.preferences.evaluate(step)
        return self.training.evaluate(step)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The whole policy on rank 0 ({} elsewhere; every training rank takes part)."""
        return self.ranks.full_state(self.training.policy)

    def send_weights(self, what: str) -> int:
        """Gather the whole policy or critic on rank 0 (every training rank takes part) and
        broadcast it over `what`'s channel; the bytes sent."""
        t = self.training
        model = t.policy if what == "policy" else t.critic if t.critic is not None else t.policy
        state = self.ranks.full_state(model)
        if has_lora(model):  # a copy's base weights never change
            state = trained_state(state)
        held = copy_dtype(self.cfg, self.device)  # as the copies hold them
        state = {k: v.to(held) if v.is_floating_point() else v for k, v in state.items()}
        return self.channels[what].send(state) if self.rank == 0 else 0

    @property
    def _stream(self) -> GenerationHost | PreferenceHost | None:
        """The host that draws this group's data: prompts to sample, or preference pairs."""
        return self.generation or self.preferences

    def generation_state(self) -> dict[str, Any]:
        return self._stream.state()

    def load_state(self, state: dict[str, Any], shards: str | None = None) -> None:
        if self.training is not None:
            self.training.load_state(state)
            if shards is not None:
                self.training.load_shards(Path(shards))
        if self._stream is not None:
            self._stream.load_state(state)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.channels.clear()  # their process groups go before the interpreter does
        # a kept process holds no model between runs; dropped before the groups go
        self.pool = self.training = self.generation = self.assessment = None
        self.preferences = None
        leave_world()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
