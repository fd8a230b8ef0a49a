"""Published end-to-end runs of peer frameworks priced by the model: each fixture row that
carries a `priced:` block (the model preset, hardware, lengths, batch and the plan the run
used, with every assumption the source leaves open written next to it) becomes a Plan and a
Workload, priced as any plan is; ratios within a pair (async/sync, N to 2N devices) and
absolute step times after calibrating on one run are compared with the published ones."""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from rlloom.algos.presets import PRESETS
from rlloom.perf.model.compose import Priced, price, role_models
from rlloom.perf.model.hardware import Hardware, hardware
from rlloom.perf.model.shapes import model_shape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Plan

EFFICIENCIES = tuple(round(0.05 * i, 2) for i in range(6, 17))  # 0.30, 0.35, ..., 0.80
DECODE_STEP_S = tuple(0.001 * i for i in range(17))  # engine host time per decode step: 0..16 ms


@dataclass(frozen=True)
class Run:
    """One published run and what the model makes of it."""
    id: str
    pair: str | None
    published_s: float
    published_stages: dict[str, float | None]
    plan: Plan
    workload: Workload
    algo: str
    model: str
    reward_model: str | None  # None: a rule verifier
    hw: Hardware
    refused: str | None = None  # why rlloom's runtime cannot hold this plan (the fixture's note)

    def priced(self, changes: dict[str, float] | None = None) -> Priced:
        reward = model_shape(self.reward_model) if self.reward_model else None
        models = role_models(model_shape(self.model), PRESETS[self.algo].roles, reward)
        return price(self.plan, models, self.workload, replace(self.hw, **(changes or {})))


def load_runs(path: Path) -> list[Run]:
    """The fixture's priced rows, in file order."""
    rows = yaml.safe_load(path.read_text())["runs"]
    return [_run(r) for r in rows if r.get("priced")]


def _run(row: dict[str, Any]) -> Run:
    p = row["priced"]
    lengths = Lengths("lognormal", p["lengths"]["p50"], p["lengths"]["p99"],
                      cap=p["lengths"]["cap"])
    wl = Workload(p["prompts"], p["samples"], p["prompt_len"], lengths,
                  minibatches=p.get("minibatches", 1), micro_batch=p.get("micro_batch", 1),
                  max_batch=p.get("max_batch", 0),
                  partial_tokens=p.get("partial_tokens", 0),
                  recompute_logprobs=p.get("recompute_logprobs", False),
                  # the peers generate on vLLM, SGLang or TensorRT-LLM: paged attention and a
                  # paged KV cache, which `rollout.engine=vllm` prices
                  engine=p.get("engine", "vllm"),
                  policy_loss=p.get("policy_loss",
                                    PRESETS[p["algo"]].overrides.get("policy_loss", "ppo")))
    # a pair of our own making (a scaling series the source does not pair) may be given
    return Run(row["id"], p.get("pair", row.get("pair_id")), float(row["step_time_s"]),
               dict(row.get("stage_s") or {}), Plan(**p["plan"]), wl, p["algo"], p["model"],
               p.get("reward_model"), hardware(p["hardware"]), p.get("refused"))


def calibrate(runs: list[Run], anchor: str) -> dict[str, float]:
    """The compute and memory efficiencies and the engine's host time per decode step that
    price run `anchor` closest to its published step time and, where published, its stage
    times; every other run is then priced with them (one calibration for all)."""
    run = next(r for r in runs if r.id == anchor)

    published = {"generation": run.published_stages.get("generation"),
                 # the other stages the fixture records are old log-prob passes, which the
                 # model prices inside training
                 "training": (run.published_stages.get("training") or 0)
                 + (run.published_stages.get("other") or 0)}

    def error(values: tuple[float, float, float]) -> float:
        p = run.priced(dict(zip(CALIBRATED, values)))
        stages = {"generation": p.gen_s, "training": p.train_s}
        return abs(p.step_s / run.published_s - 1) + sum(
            abs(stages[k] / published[k] - 1) for k in stages if published[k])
    best = min(itertools.product(EFFICIENCIES, EFFICIENCIES, DECODE_STEP_S), key=error)
    return dict(zip(CALIBRATED, best))


CALIBRATED = ("compute_eff", "mem_eff", "decode_step_s")


@dataclass(frozen=True)
class Comparison:
    what: str
    published: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def compare(runs: list[Run], changes: dict[str, float] | None = None
            ) -> tuple[list[Comparison], list[Comparison], list[Priced]]:
    """(absolute step times, ratios of each pair's later runs to its first, the priced
    plans)."""
    priced = [r.priced(changes) for r in runs]
    steps = [Comparison(r.id, r.published_s, p.step_s) for r, p in zip(runs, priced)]
    ratios = []
    for pair, members in itertools.groupby(
            sorted(range(len(runs)), key=lambda i: (runs[i].pair or "", i)),
            key=lambda i: runs[i].pair):
        members = list(members)
        if pair is None or len(members) < 2:
            continue
        base = members[0]
        for i in members[1:]:
            ratios.append(Comparison(f"{runs[i].id} / {runs[base].id}",
                                     runs[i].published_s / runs[base].published_s,
                                     priced[i].step_s / priced[base].step_s))
    return steps, ratios, priced


def table(runs: list[Run], anchor: str) -> str:
    """The markdown tables docs/performance-model.md shows: every priced run's step time
    (published, predicted with catalogue efficiencies, predicted after calibrating on
    `anchor`), its stages, and the pairs' ratios."""
    fitted = calibrate(runs, anchor)
    raw, raw_ratios, _ = compare(runs)
    cal, cal_ratios, priced = compare(runs, fitted)
    lines = [f"Calibrated on `{anchor}`: compute_eff {fitted['compute_eff']:.2f}, mem_eff "
             f"{fitted['mem_eff']:.2f}, decode step {fitted['decode_step_s'] * 1e3:.0f} ms.",
             "",
             "| run | published s | predicted s (catalogue) | predicted s (calibrated) | error "
             "| published gen / train / other s | predicted gen / train / assess s |",
             "|---|---|---|---|---|---|---|"]
    for run, a, b, p in zip(runs, raw, cal, priced):
        pub = " / ".join("-" if run.published_stages.get(k) is None
                         else f"{run.published_stages[k]:.0f}"
                         for k in ("generation", "training", "other"))
        lines.append(f"| {run.id} | {a.published:.1f} | {a.predicted:.1f} | {b.predicted:.1f} "
                     f"| {b.error:+.0%} | {pub} | {p.gen_s:.0f} / {p.train_s:.0f} / "
                     f"{p.assess_s:.0f} |")
    lines += ["", "| ratio | published | predicted (catalogue) | predicted (calibrated) | error |",
              "|---|---|---|---|---|"]
    for a, b in zip(raw_ratios, cal_ratios):
        lines.append(f"| {a.what} | {a.published:.2f} | {a.predicted:.2f} | {b.predicted:.2f} "
                     f"| {b.error:+.0%} |")
    held_out = [abs(c.error) for c in cal if c.what != anchor]
    lines += ["", f"Median |error| of the held-out step times: {statistics.median(held_out):.0%}; "
              f"of the ratios: {statistics.median(abs(c.error) for c in cal_ratios):.0%}."]
    return "\n".join(lines)
