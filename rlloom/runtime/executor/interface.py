"""What every executor shares, and nothing else of the executor is imported here: how a run
is executed (`RunOptions`), one call on a group's ranks (`GroupCall`), a worker that failed
(`WorkerFailure`), and the executor the step loop drives (`Executor`, `Group`). The one-process
executor (`local.py`) and the Ray one (`ray/executor.py`) implement the protocols."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlloom.plan import DeviceGroup


@dataclass
class RunOptions:
    """How the executor runs (the plan says what runs where); the cluster, CPU and fault
    fields are the Ray executor's."""
    address: str | None = None      # join this cluster ("auto", "host:6379"); None: start one
    worker_timeout_s: float = 600.0  # longest wait for any worker answer once started
    startup_timeout_s: float = 600.0  # longest wait for a group's resources and models
    max_restarts: int = 0           # times the driver may recreate the groups after a fault
    group_cpus: dict[str, float] = field(default_factory=dict)  # group -> CPUs per rank (1)
    num_cpus: float | None = None   # CPUs of a started instance (default: cores or more)
    fused_chunks: int = 2           # generation requests per step of a fused schedule
    fault: str | None = None        # test hook "kill|stop:<group>[/rank]:<step>", first try
    # called on the driver with each step's metrics row; one returning False stops the run
    # after that step (rlloom.train's callbacks)
    callbacks: tuple[Callable[[dict[str, Any]], Any], ...] = ()

    def cpus(self, group: str) -> float:
        return float(self.group_cpus.get(group, 1.0))


class WorkerFailure(RuntimeError):
    """A worker died or stopped answering; names its group, the stages it runs and its rank."""

    def __init__(self, group: str, rank: int, stages: tuple[str, ...], state: str, what: str,
                 step: int, cause: str, detected_after_s: float | None = None,
                 node: str | None = None) -> None:
        self.group, self.rank, self.stages, self.state = group, rank, stages, state
        self.what, self.step, self.cause, self.node = what, step, cause, node
        self.detected_after_s = detected_after_s
        self.run_dir: Path | None = None  # set by launch.train
        where = f" on node {node}" if node else ""
        super().__init__(
            f"worker rank {rank} of group {group!r}{where} (stages: {', '.join(stages)}) {state} "
            f"while the driver waited for {what} of step {step}: {cause}")

    def record(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "node": self.node,
                "stages": list(self.stages),
                "state": self.state, "what": self.what, "step": self.step,
                "cause": self.cause[:500], "detected_after_s": self.detected_after_s}


@dataclass
class GroupCall:
    """One method called on every rank of a group: `refs[rank]` is that rank's ObjectRef, or
    its tuple of refs for several returns. The group's answer is rank 0's; the others are
    waited on too, so a rank that fails is seen even while rank 0 waits for it in a
    collective."""
    refs: list[Any]

    @property
    def lead(self) -> Any:
        return self.refs[0]

    def part(self, i: int) -> "GroupCall":
        """The i-th of several returns, on every rank."""
        return GroupCall([r[i] for r in self.refs])


# A method of `worker.GroupWorker` or of a stage host it holds, named by reference
# (`GroupWorker.generate`, `TrainingHost.train`) so that the type checker sees every call a
# driver makes to a rank
Method = Callable[..., Any]


def routed(method: Method) -> tuple[str, tuple[Any, ...]]:
    """The GroupWorker method a group call of `method` runs, and the arguments it leads with:
    the worker's own method, or a stage host's through `GroupWorker.run`."""
    owner, _, name = method.__qualname__.rpartition(".")
    return (name, ()) if owner == "GroupWorker" else ("run", (method.__qualname__,))


class Group(Protocol):
    spec: DeviceGroup

    @property
    def name(self) -> str: ...

    def call(self, method: Method, *args: Any, num_returns: int = 1, control: bool = False
             ) -> GroupCall: ...


class Executor(Protocol):
    """What runs the groups. `call` submits a method to every rank of a group (at once, or
    run in place), `get` waits for answers and names a failed rank; files are written where
    `main` is true."""
    main: bool
    label: str

    def start(self) -> None: ...
    def stop(self, reuse: bool = False) -> None: ...
    def group(self, name: str) -> Group: ...
    def get(self, refs: Any, what: str, step: int, group: Group | None = None,
            timeout_s: float | None = None) -> Any: ...
    def answers(self, call: GroupCall) -> list[Any]: ...
    def first_ready(self, refs: list[Any], what: str, step: int, group: Group
                    ) -> list[int]: ...
    def put(self, value: Any) -> Any: ...
    def inject(self, step: int) -> None: ...
    def spans(self) -> list[dict]: ...
    def watch(self, on_stage: Callable[[str], None]) -> None: ...
    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int) -> None: ...
    def barrier(self) -> None: ...
