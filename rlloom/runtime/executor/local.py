"""The executor in this process: a colocated plan's one group (`plan.device_groups`) as this
process alone (one rank, where every collective is the identity) or as one rank of a torchrun
world (`join_torchrun`; what one can run: `preflight.torchrun_problems`), where every process
runs the same step loop (SPMD) and calls its own `GroupWorker` in place; the stage code is
what a Ray rank runs."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlloom.config import RunConfig
from rlloom.plan import DeviceGroup
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.device import torchrun_device
from rlloom.runtime.executor.groups import world_size
from rlloom.runtime.executor.interface import GroupCall, Method, routed
from rlloom.runtime.executor.worker import GroupWorker
from rlloom.runtime.ranks import RankGroup


def join_torchrun(requested: str) -> RankGroup:
    """This process's place in the world torchrun started, on its device for
    `train.device=requested` (cuda:LOCAL_RANK under NCCL, else the CPU with gloo)."""
    return RankGroup.join(torchrun_device(requested), world=world_size())


class LocalGroup:
    """A group whose rank is this process: a call runs at once, and its answer is the
    call's `lead` (so answers pass to later calls as they are)."""

    def __init__(self, spec: DeviceGroup, worker: GroupWorker) -> None:
        self.spec, self.worker = spec, worker

    @property
    def name(self) -> str:
        return self.spec.name

    def call(self, method: Method, *args: Any, num_returns: int = 1, control: bool = False
             ) -> GroupCall:
        name, lead = routed(method)
        return GroupCall([getattr(self.worker, name)(*lead, *args)])


class LocalExecutor:
    label = "rl"

    def __init__(self, cfg: RunConfig, model_path: Path, spec: DeviceGroup,
                 device: torch.device) -> None:
        self.cfg, self.model_path, self.spec, self.device = cfg, model_path, spec, device
        self.rank = int(os.environ.get("RANK", "0"))
        self.local: LocalGroup | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def worker(self) -> GroupWorker:
        assert self.local is not None, "start the executor first"
        return self.local.worker

    def start(self) -> None:
        """Join the world (torchrun's) and build the models; once."""
        if self.local is not None:
            return
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # they share the cores
        threads = self.cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world)
        worker = GroupWorker(self.cfg, str(self.model_path), self.spec, self.rank, threads,
                             str(self.device), spmd=True)
        worker.start(None, 600.0)
        self.local = LocalGroup(self.spec, worker)

    def stop(self, reuse: bool = False) -> None:
        """Close this process's rank (it is reused anyway: the next run binds a new one)."""
        if self.local is not None:
            self.local.worker.close()
            self.local = None

    def group(self, name: str) -> LocalGroup:
        assert self.local is not None and name == self.spec.name, name
        return self.local

    def get(self, refs: Any, what: str, step: int, group: LocalGroup | None = None,
            timeout_s: float | None = None) -> Any:
        if isinstance(refs, GroupCall):
            return refs.lead
        if isinstance(refs, list) and refs and isinstance(refs[0], GroupCall):
            return [c.lead for c in refs]
        return refs

    def answers(self, call: GroupCall) -> list[Any]:
        return list(call.refs)

    def first_ready(self, refs: list[Any], what: str, step: int, group: LocalGroup
                    ) -> list[int]:
        return list(range(len(refs)))  # ran in submission order, all done

    def put(self, value: Any) -> Any:
        return value

    def inject(self, step: int) -> None:
        """Faults are injected into Ray workers only."""

    def spans(self) -> list[dict]:
        return self.worker.spans.drain()

    def watch(self, on_stage: Callable[[str], None]) -> None:
        """Tell `on_stage` each stage's name as this process starts it."""
        self.worker.spans.on_start = on_stage

    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> None:
        """The checkpoint, written by rank 0; in a world of several ranks every rank first
        writes its DCP shards into the directory rank 0 names."""
        ranks = self.worker.ranks
        if ranks.world == 1:
            save_state(run_dir, step, state, keep)
            return

        def shards(tmp: Path) -> None:
            self.worker.training.save_shards(Path(ranks.gather(str(tmp))[0]))
        if ranks.main:
            save_state(run_dir, step, state, keep, write=shards)
        else:
            shards(Path())
        ranks.barrier()

    def barrier(self) -> None:
        self.worker.ranks.barrier()
