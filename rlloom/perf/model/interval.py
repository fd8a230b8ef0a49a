"""How sure a price is: an interval around a plan's step time from what is known to vary.

- The response lengths: every step draws B*K of them, and its longest bounds generation;
  the plan's step is priced again at `DRAWS` sampled steps (as `rlloom simulate` samples
  them), whose 10th and 90th percentiles bound it (a fixed length draws nothing).
- The hardware: a measured file's repeats spread (`spread_max`, `rlloom bench hw`) and a
  calibrated file's residual (`calibration_error`, `rlloom perf calibrate`), combined in
  quadrature as one relative error on the whole step. A catalogue entry carries neither:
  its interval is the lengths' alone, and says nothing of the catalogue's own estimates.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from rlloom.perf.model.compose import price
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload, step_lengths
from rlloom.plan import Layout, Plan

DRAWS = 16
QUANTILES = (0.1, 0.9)


@dataclass(frozen=True)
class Interval:
    low: float
    mid: float  # the central estimate: the plan priced at the whole distribution
    high: float

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    @property
    def half_width(self) -> float:
        """The larger side, relative to the central estimate."""
        return max(self.mid - self.low, self.high - self.mid) / self.mid if self.mid else 0.0

    def __str__(self) -> str:
        return f"{self.low:.3g}-{self.high:.3g}"


def hardware_error(hw: Hardware) -> float:
    """One relative error on every time the file prices: its measurement's spread and its
    calibration's residual, in quadrature (0 for a catalogue entry)."""
    return math.hypot(hw.extra.get("spread_max", 0.0), hw.extra.get("calibration_error", 0.0))


def step_interval(plan: Plan, models: dict[str, ModelShape | None], wl: Workload,
                  hw: Hardware, gen_layout: Layout | None = None, offline: bool = False,
                  mid: float | None = None, seed: int = 0) -> Interval:
    """The interval of `plan`'s step time (module docstring); `mid`: its price, when known."""
    if mid is None:
        mid = price(plan, models, wl, hw, gen_layout, offline).step_s
    low = high = mid
    if wl.response.kind != "fixed":
        rng = random.Random(seed)
        steps = sorted(price(plan, models, replace(wl, response=step_lengths(wl, rng)), hw,
                             gen_layout, offline).step_s for _ in range(DRAWS))
        low = min(low, steps[int(QUANTILES[0] * (DRAWS - 1))])
        high = max(high, steps[math.ceil(QUANTILES[1] * (DRAWS - 1))])
    error = hardware_error(hw)
    return Interval(low * (1 - error), mid, high * (1 + error))
