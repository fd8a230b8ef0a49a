"""The non-finite guard: a step whose reward, advantage, loss or gradient norm is NaN or
infinite never reaches the optimizer (`train.on_nonfinite`: `stop`, the default, ends the run
naming the step and the quantity; `skip` drops that update and counts it).

Training stages report what they found as numbers (they are averaged over a group's ranks,
which all see the same global values): `nonfinite` is the 1-based index of the quantity in
`QUANTITIES` that stopped the step, `nonfinite_skips` the updates dropped."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

QUANTITIES = ("reward", "advantage", "policy loss or gradient norm",
              "critic loss or gradient norm", "preference loss or gradient norm")

_CAUSES = {
    "reward": "a reward function or reward model returned NaN or inf",
    "advantage": "the rewards are finite, so the advantage estimator divided by a zero "
                 "spread or the critic's values are not finite",
}
_DIVERGED = ("the model diverged: the learning rate (train.lr) is likely too high, or "
             "train.grad_clip too loose")


class NonFiniteStop(RuntimeError):
    """A step met a non-finite quantity under train.on_nonfinite=stop."""


def code(quantity: str) -> float:
    return float(QUANTITIES.index(quantity) + 1)


def finite(t: torch.Tensor) -> bool:
    return bool(t.isfinite().all())


def stop_message(step: int, code_: float, lr: float, last_checkpoint: str | None,
                 run_dir: str, row: dict[str, float] | None = None) -> str:
    """What the run says when it stops; `row` (the step's metrics) names the reward terms
    that were not finite."""
    quantity = QUANTITIES[int(code_) - 1]
    cause = _CAUSES.get(quantity, _DIVERGED + f" (train.lr={lr:g})")
    terms = sorted(k for k, v in (row or {}).items() if k.startswith("reward/")
                   and isinstance(v, float) and not math.isfinite(v))
    if quantity == "reward" and terms:
        cause = f"{', '.join(terms)} returned NaN or inf"
    # a reward's fault is not the learning rate's: the fix is the reward
    remedy = "and a smaller train.lr" if quantity not in _CAUSES else "once the reward is fixed"
    kept = (f"the last checkpoint is {last_checkpoint}; continue from it with rlloom train "
            f"--resume {run_dir} {remedy}" if last_checkpoint else
            "no checkpoint was written before it")
    return (f"step {step}: the {quantity} is not finite, so nothing of this step was applied "
            f"and no checkpoint was written from it. Likely cause: {cause}. {kept}; or set "
            "train.on_nonfinite=skip to drop such updates and go on")
