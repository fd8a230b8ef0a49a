"""A `torchrun` world as one colocated group (`ranks.RankGroup`, whose docstring gives the
data flow): how a process joins it (what it can run: `preflight.torchrun_problems`). The
step loop runs the executor's roles on it, so every layout a group takes runs here too."""
from __future__ import annotations

from rlloom.runtime.device import torchrun_device
from rlloom.runtime.executor.groups import world_size
from rlloom.runtime.ranks import RankGroup


def join_torchrun(requested: str) -> RankGroup:
    """This process's place in the world torchrun started, on its device for
    `train.device=requested` (cuda:LOCAL_RANK under NCCL, else the CPU with gloo)."""
    return RankGroup.join(torchrun_device(requested), world=world_size())
