"""The cluster a Ray run uses and how a failed worker is reported: a local instance with its
files under the run directory (or a joined cluster), and the errors that name the group,
roles and rank of a dead or silent worker."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError
from rlloom.data.prompts import DataError
from rlloom.models.hf_io import CheckpointError
from rlloom.runtime.ray_plan import GroupSpec, RayOptions

MAX_TEMP_DIR_CHARS = 42  # Ray's socket paths under its temp dir must stay below ~107 chars
USER_ERRORS = (ConfigError, DataError, CheckpointError)


# -- cluster ---------------------------------------------------------------------------------

def ray_temp_dir(run_dir: Path) -> tuple[Path, str | None]:
    """<run_dir>/ray, or, when that path is too long for Ray's sockets, a short directory
    under /tmp that <run_dir>/ray links to (and a note saying so)."""
    temp = (run_dir / "ray").absolute()
    if len(str(temp)) <= MAX_TEMP_DIR_CHARS:
        return temp, None
    short = Path(tempfile.mkdtemp(prefix="rlloom-ray-", dir="/tmp"))
    if temp.is_symlink():  # a resumed run: point it at this session's files
        temp.unlink()
    if not temp.exists():
        temp.symlink_to(short, target_is_directory=True)
    return short, (f"Ray's files are in {short}: the run directory's path is too long for "
                   f"Ray's socket paths ({MAX_TEMP_DIR_CHARS} characters at most); {temp} "
                   "links there")


class Cluster:
    """A local Ray instance with its files under the run directory, or a connection to an
    existing cluster; leaves an instance that was already running in this process alone."""

    def __init__(self, opts: RayOptions, run_dir: Path, cpus: float) -> None:
        import ray
        self.owned = not ray.is_initialized()
        self.note: str | None = None
        if not self.owned:
            return
        if opts.address:
            try:
                ray.init(address=opts.address, log_to_driver=True)
            except (ConnectionError, RuntimeError) as e:
                raise ConfigError(
                    f"cannot join the Ray cluster at {opts.address}: {first_line(e)}. Check the "
                    "address `ray start --head` printed; a cluster with token authentication "
                    "(Ray >= 2.59 turns it on by default) also needs RAY_AUTH_MODE=token and its "
                    "token (RAY_AUTH_TOKEN or ~/.ray/auth_token) here; see docs/ray.md") from None
            return
        temp, self.note = ray_temp_dir(run_dir)
        ray.init(num_cpus=max(cpus, opts.num_cpus or 0, os.cpu_count() or 1),
                 _temp_dir=str(temp), include_dashboard=False, log_to_driver=True)

    def stop(self) -> None:
        import ray
        if self.owned and ray.is_initialized():
            ray.shutdown()


# -- faults ----------------------------------------------------------------------------------

class WorkerFailure(RuntimeError):
    """A worker died or stopped answering; names its group, roles and rank."""

    def __init__(self, group: str, rank: int, roles: tuple[str, ...], state: str, what: str,
                 step: int, cause: str, detected_after_s: float | None = None) -> None:
        self.group, self.rank, self.roles, self.state = group, rank, roles, state
        self.what, self.step, self.cause = what, step, cause
        self.detected_after_s = detected_after_s
        self.run_dir: Path | None = None  # set by train_ray
        super().__init__(
            f"worker rank {rank} of group {group!r} (roles: {', '.join(roles)}) {state} while "
            f"the driver waited for {what} of step {step}: {cause}")

    def record(self) -> dict[str, Any]:
        return {"group": self.group, "rank": self.rank, "roles": list(self.roles),
                "state": self.state, "what": self.what, "step": self.step,
                "cause": self.cause[:500], "detected_after_s": self.detected_after_s}


@dataclass
class WorkerGroup:
    spec: GroupSpec
    pg: Any
    actor: Any
    info: dict[str, Any]  # pid, host

    @property
    def name(self) -> str:
        return self.spec.name


def start_error(e: BaseException, group: WorkerGroup | None) -> Exception:
    """A worker's constructor raised: the user error it raised (a bad reward model, say),
    else a RuntimeError with its last line."""
    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    name, _, message = last.partition(": ")
    for cls in USER_ERRORS:
        if name.rsplit(".", 1)[-1] == cls.__name__:
            return cls(message)
    where = f"group {group.name!r}" if group else "a group"
    return RuntimeError(f"the worker of {where} failed to start: {last}")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def diagnose(groups: list[WorkerGroup], what: str, step: int, cause: str,
             actor_id: str | None, waited_on: WorkerGroup | None, ping_s: float,
             detected_after_s: float | None) -> WorkerFailure:
    """Ping every worker to tell the dead or silent one from those merely waiting."""
    import ray
    from ray.exceptions import RayActorError
    pings = [g.actor.ping.options(concurrency_group="control").remote() for g in groups]
    ray.wait(pings, num_returns=len(pings), timeout=ping_s)
    states: dict[str, str] = {}
    for g, ref in zip(groups, pings):
        try:
            ray.get(ref, timeout=0.01)
            states[g.name] = "is alive"
        except RayActorError:
            states[g.name] = "died"
        except Exception:
            states[g.name] = f"did not answer a ping within {ping_s:g}s"
    by_id = [g for g in groups if actor_id and g.actor._actor_id.hex() == actor_id]
    dead = [g for g in groups if states[g.name] == "died"]
    silent = [g for g in groups if states[g.name].startswith("did not")]
    culprit = (by_id or dead or silent or [waited_on or groups[0]])[0]
    return WorkerFailure(culprit.name, 0, culprit.spec.roles, states[culprit.name], what,
                         step, cause, detected_after_s)
