"""What one RL step processes: prompts, samples, prompt and response lengths."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist
from typing import Literal

Z99 = NormalDist().inv_cdf(0.99)


@dataclass(frozen=True)
class Lengths:
    """Response length distribution in tokens.

    fixed: always `p50`; uniform: between `low` and `high`; lognormal: median `p50` and 99th
    percentile `p99`. For lognormal, `max` is p99 (the top 1% are truncated there: a generation
    cap at p99 is what long-reasoning runs set, and the true maximum of a lognormal is infinite).
    """
    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    p50: float = 512
    p99: float = 0
    low: float = 0
    high: float = 0

    def __post_init__(self) -> None:
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError("uniform lengths need 0 <= low <= high")
        if self.kind == "lognormal" and not self.p99 > self.p50 > 0:
            raise ValueError("lognormal lengths need p99 > p50 > 0")

    @property
    def _sigma(self) -> float:
        return math.log(self.p99 / self.p50) / Z99

    def quantile(self, q: float) -> float:
        if self.kind == "fixed":
            return self.p50
        if self.kind == "uniform":
            return self.low + q * (self.high - self.low)
        return min(self.p50 * math.exp(self._sigma * NormalDist().inv_cdf(q)), self.p99)

    @property
    def max(self) -> float:
        return {"fixed": self.p50, "uniform": self.high, "lognormal": self.p99}[self.kind]

    @cached_property
    def mean(self) -> float:
        """Mean of the distribution as generated (the lognormal truncated at p99), by quadrature."""
        if self.kind != "lognormal":
            return self.p50 if self.kind == "fixed" else (self.low + self.high) / 2
        return sum(self.spread(2000)) / 2000

    def spread(self, n: int) -> list[float]:
        """n lengths at evenly spaced quantiles, ascending: a deterministic sample that keeps the
        tail, so simulated generation sees the live batch shrink."""
        return [self.quantile((i + 0.5) / n) for i in range(n)]

    def sample(self, n: int, rng: random.Random) -> list[float]:
        return sorted(self.quantile(rng.random()) for _ in range(n))


@dataclass(frozen=True)
class Workload:
    """One RL step: B prompts x K samples, prompt length S, response lengths T."""
    prompts: int = 256  # B
    samples: int = 8  # K
    prompt_len: int = 512  # S
    response: Lengths = Lengths()
    ppo_epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    micro_batch: int = 4  # sequences per device per forward/backward

    @property
    def rollouts(self) -> int:
        return self.prompts * self.samples

    @property
    def mean_context(self) -> float:
        return self.prompt_len + self.response.mean

    @property
    def max_context(self) -> float:
        return self.prompt_len + self.response.max

    @property
    def tokens(self) -> float:
        """Tokens teacher-forced per pass over the batch: B K (S + mean T)."""
        return self.rollouts * self.mean_context
