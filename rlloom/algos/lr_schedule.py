"""Learning-rate schedules of RL training, a function of the step alone: a resumed run sets the
rate it would have had, with no scheduler state to save."""
from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]


def lr_factor(step: int, steps: int, schedule: Schedule, warmup: int = 0,
              min_ratio: float = 0.0) -> float:
    """The multiplier of the base learning rate at RL step `step` (1-based) of `steps`: a
    linear warm-up over the first `warmup` steps (step / warmup, never 0), then constant, or a
    linear or cosine decay from 1 at the first step after the warm-up towards `min_ratio`,
    which it would reach one step after the last (transformers' convention: step s here is
    its step s - 1), so the last step still learns."""
    if step <= warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup - 1) / max(1, steps - warmup)
    shape = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * shape
