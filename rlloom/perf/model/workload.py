"""What one RL step processes: prompts, samples, prompt and response lengths."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Literal

from rlloom.perf.model.buckets import padded_tokens, split_sorted

_NORMAL = NormalDist()  # the standard normal, one instance for every quantile asked
Z99 = _NORMAL.inv_cdf(0.99)


@dataclass(frozen=True)
class Lengths:
    """Response length distribution in tokens.

    fixed: always `p50`; uniform: between `low` and `high`; lognormal: median `p50` and 99th
    percentile `p99`, cut at the generation cap `cap` (default p99): every response the
    lognormal would make longer stops at the cap, a mass of truncated responses there (1% at
    the default; `1 - Phi(ln(cap / p50) / sigma)` in general). empirical: measured lengths
    (`values`, e.g. a run's metrics.jsonl), every step drawing from them as they are.
    """
    kind: Literal["fixed", "uniform", "lognormal", "empirical"] = "fixed"
    p50: float = 512
    p99: float = 0
    low: float = 0
    high: float = 0
    values: tuple[float, ...] = ()
    cap: float = 0  # lognormal: the generation cap (max new tokens); 0 = p99

    def __post_init__(self) -> None:
        if self.kind == "uniform" and not 0 <= self.low <= self.high:
            raise ValueError("uniform lengths need 0 <= low <= high")
        if self.kind == "lognormal" and not self.p99 > self.p50 > 0:
            raise ValueError("lognormal lengths need p99 > p50 > 0")
        if self.cap and not self.cap > self.p50:
            raise ValueError(f"the response cap ({self.cap:g}) must exceed the median "
                             f"({self.p50:g})")
        if self.kind == "empirical":
            if not self.values or min(self.values) < 0:
                raise ValueError("empirical lengths need at least one length, none negative")
            object.__setattr__(self, "values", tuple(sorted(self.values)))

    @classmethod
    def empirical(cls, values: list[float]) -> "Lengths":
        ordered = sorted(values)
        return cls("empirical", p50=ordered[len(ordered) // 2], values=tuple(ordered))

    @property
    def _sigma(self) -> float:
        return math.log(self.p99 / self.p50) / Z99

    def quantile(self, q: float) -> float:
        if self.kind == "fixed":
            return self.p50
        if self.kind == "uniform":
            return self.low + q * (self.high - self.low)
        if self.kind == "empirical":
            return self.values[min(int(q * len(self.values)), len(self.values) - 1)]
        return min(self.p50 * math.exp(self._sigma * _NORMAL.inv_cdf(q)), self.max)

    @property
    def max(self) -> float:
        if self.kind == "empirical":
            return self.values[-1]
        return {"fixed": self.p50, "uniform": self.high,
                "lognormal": self.cap or self.p99}[self.kind]

    @property
    def at_cap(self) -> float:
        """The share of responses the cap truncates (lognormal), 0 otherwise."""
        if self.kind != "lognormal":
            return 0.0
        return 1 - _NORMAL.cdf(math.log(self.max / self.p50) / self._sigma)

    @cached_property
    def mean(self) -> float:
        """Mean of the distribution as generated (the lognormal cut at its cap), by quadrature."""
        if self.kind == "empirical":
            return sum(self.values) / len(self.values)
        if self.kind != "lognormal":
            return self.p50 if self.kind == "fixed" else (self.low + self.high) / 2
        return sum(self.spread(2000)) / 2000

    def scaled(self, f: float) -> "Lengths":
        """The same distribution with every length times `f` (one turn's share of a
        multi-turn response)."""
        return replace(self, p50=self.p50 * f, p99=self.p99 * f, low=self.low * f,
                       high=self.high * f, cap=self.cap * f,
                       values=tuple(v * f for v in self.values))

    @lru_cache(maxsize=1024)  # the planner prices the same lengths for every layout
    def spread(self, n: int) -> tuple[float, ...]:
        """n lengths at evenly spaced quantiles, ascending: a deterministic sample that keeps the
        tail, so simulated generation sees the live batch shrink."""
        return tuple(self.quantile((i + 0.5) / n) for i in range(n))

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
    dtype: Literal["bf16", "fp32"] = "bf16"  # of weights, activations and KV cache
    # 0: teacher-forced passes compute exactly the real tokens (packed sequences) in
    # micro-batches of `micro_batch` rows; > 0: rlloom's single-process runtime, which runs
    # each distinct prompt once, then the responses in length buckets padded to their longest
    # row and cut at this many padded tokens
    micro_batch_tokens: int = 0
    # the engine's KV slots per generation replica (`rollout.max_batch`); 0: as many as the
    # memory left after the model state holds
    max_batch: int = 0
    # the generation engine (`rollout.engine`): rlloom's holds a slot of the longest context
    # per rollout; vLLM's paged cache holds the blocks a rollout has filled, up to
    # VLLM_MAX_SEQS rollouts at once
    engine: Literal["rlloom", "vllm"] = "rlloom"
    policy_loss: str = "ppo"  # the algorithm's loss (stale samples of ppo losses are corrected)
    # partial rollouts (`rollout.partial_tokens`): tokens a response generates per step before
    # it is carried to the next; 0 = off
    partial_tokens: int = 0
    # old log-probs recomputed by a forward of the actor before every update (verl's and
    # OpenRLHF's default, priced for their runs); rlloom takes its own engine's, recomputes
    # another engine's (algos/rollout_correction.recomputes_behaviour), and the proximal
    # log-probs of stale samples
    recompute_logprobs: bool = False
    # LoRA adapters of this rank train on the actor (`model.lora.rank`); 0 = full training
    lora_rank: int = 0
    # multi-turn rollouts with tools (`rollout.max_turns`): model turns per rollout, each but
    # the last ending in a tool call whose latency in seconds `tool_latency` gives; the
    # response lengths count every turn and tool result
    turns: int = 1
    tool_latency: Lengths = Lengths("fixed", 0.0)
    tool_result_len: int = 0  # tokens each tool result inserts (counted in `response`)
    # MoE routing replay (`algo.routing_replay`): generation keeps each token's experts, and
    # the actor trains without the shared prompt pass (each row replays its own routes)
    routing_replay: bool = False

    @property
    def carries(self) -> bool:
        """Whether partial rollouts carry responses across steps (a chunk shorter than the
        longest response)."""
        return 0 < self.partial_tokens < self.response.max

    def device_minibatch(self, dp: int, prompts_once: bool = False, pp: int = 1
                         ) -> tuple[int, float, int]:
        """(rows, teacher-forced tokens, micro-batches) of one data-parallel rank's
        mini-batch; through `pp` pipeline stages, each micro-batch's rows repeated up to a
        multiple of its pieces (`pipeline_rows`)."""
        rows = math.ceil(math.ceil(self.rollouts / dp) / self.minibatches)
        tokens, m = self.teacher_forced(rows, prompts_once)
        per = math.ceil(rows / m)
        return rows, tokens * pipeline_rows(per, pp) / per, m

    @lru_cache(maxsize=4096)  # the same workloads are priced on many hardwares
    def teacher_forced(self, rows: int, prompts_once: bool = False) -> tuple[float, int]:
        """(tokens computed, forward passes) of one forward over `rows` rollouts.
        `prompts_once`: the runtime's shared prompt pass applies (the policy's log-probs and
        the reference's; not value or reward heads)."""
        if self.micro_batch_tokens <= 0:
            return rows * self.mean_context, max(1, math.ceil(rows / self.micro_batch))
        lengths = self.response.spread(rows)  # ascending, as the runtime sorts rows
        prompts = [float(self.prompt_len)] * rows
        bounds = split_sorted(prompts, lengths, self.micro_batch_tokens,
                              prompts_done=prompts_once)
        tokens = padded_tokens(prompts, lengths, bounds, prompts_done=prompts_once)
        if not prompts_once:
            return tokens, len(bounds)
        return self.distinct_prompts(rows) * self.prompt_len + tokens, len(bounds) + 1

    def distinct_prompts(self, rows: int) -> float:
        """Expected distinct prompts among `rows` rollouts drawn at random from the B K of a
        step (K per prompt): B (1 - C(BK - K, rows) / C(BK, rows))."""
        n, k = self.rollouts, self.samples
        rows = min(rows, n)
        missed = 1.0  # C(n - k, rows) / C(n, rows) as a product of k factors
        for i in range(k):
            missed *= max(n - rows - i, 0) / (n - i)
        return self.prompts * (1 - missed)

    @property
    def elem_bytes(self) -> int:
        return 2 if self.dtype == "bf16" else 4

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


def lengths_from(path: Path) -> Lengths:
    """Response lengths measured elsewhere: every `response_lens` of a run (its directory or
    metrics.jsonl), or a file of lengths (a JSON list, or one number per line)."""
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise ValueError(f"{metrics}: not found; pass a run directory, its metrics.jsonl or a "
                         "file of lengths (a JSON list or one per line)")
    text = metrics.read_text()
    if metrics.name == "metrics.jsonl":
        values = [n for line in text.splitlines()
                  for n in json.loads(line).get("response_lens", [])]
        if not values:
            raise ValueError(f"{metrics}: no response_lens recorded (an offline run, or one "
                             "made before lengths were logged)")
        return Lengths.empirical(values)
    try:
        values = (json.loads(text) if text.lstrip().startswith("[")
                  else [float(x) for x in text.split()])
    except ValueError:
        raise ValueError(f"{metrics}: not a JSON list of lengths nor one number per "
                         "line") from None
    if not values:
        raise ValueError(f"{metrics}: no lengths in it")
    return Lengths.empirical([float(v) for v in values])


def step_lengths(wl: Workload, rng: random.Random) -> Lengths:
    """One step's B*K lengths, drawn from the workload's distribution and priced as they are
    (no refit: `rlloom plan` and `rlloom simulate` read one distribution the same way)."""
    return Lengths.empirical(wl.response.sample(wl.rollouts, rng))


def pipeline_rows(rows: int, pp: int) -> int:
    """The rows a micro-batch of `rows` runs through `pp` pipeline stages: a multiple of its
    pp pieces (`runtime.stages.pipelined.pipeline_rows` repeats rows up to it)."""
    return -(-rows // pp) * pp
