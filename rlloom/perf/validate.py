"""`rlloom perf validate`: predict each stage of a finished run's steps with the cost model and
this machine's hardware file, next to what the run measured. `rlloom perf calibrate`: the
compute and memory efficiencies that fit some runs best, to validate on others.

Each step is priced with its own workload: its number of rollouts, mean prompt length and the
exact response lengths it generated (metrics.jsonl), with the run's plan (placement, layouts,
schedule), in the run's dtype. Measured times are the run's stage spans (the same spans as
trace.json, with reward scoring counted under assessment as the runtime logs it).
"""
from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import yaml

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.perf.compose import price, role_models
from rlloom.perf.hardware import Hardware
from rlloom.perf.shapes import ModelShape, model_shape
from rlloom.perf.workload import Lengths, Workload
from rlloom.plan import Plan

STAGES = (("generation", "gen_s"), ("assessment", "assess_s"), ("training", "train_s"))


@dataclass(frozen=True)
class StagePoint:
    run: str
    step: int
    stage: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def run_shape(run_dir: Path, cfg: RunConfig) -> ModelShape:
    """The policy's shape from the run's exported model, or from the model it started from."""
    for candidate in (run_dir / "final" / "config.json",
                      Path(cfg.model.path or "") / "config.json"):
        if candidate.is_file():
            return ModelShape.from_hf_config(json.loads(candidate.read_text()), "policy")
    raise ValueError(f"{run_dir}: no final/config.json and no model.path config.json; "
                     "validate a finished run")


def critic_shape(cfg: RunConfig) -> ModelShape | None:
    """The critic's shape when it starts from a checkpoint of its own (`model.critic_path`)."""
    return model_shape(cfg.model.critic_path) if cfg.model.critic_path else None


def run_dtype(cfg: RunConfig) -> str:
    """The dtype a run computes in: bf16 weights, or bf16 autocast (`train.compute_dtype`,
    whose `auto` is bf16 on a CUDA `train.device`; `train.device=auto` is priced as fp32)."""
    bf16 = cfg.model.dtype == "bfloat16" or cfg.train.compute_dtype == "bfloat16" or (
        cfg.train.compute_dtype == "auto" and cfg.train.device.startswith("cuda"))
    return "bf16" if bf16 else "fp32"


def step_workload(row: dict, cfg: RunConfig) -> Workload:
    lengths = row["response_lens"]
    samples = cfg.rollout.n_samples
    return Workload(prompts=len(lengths) // samples, samples=samples,
                    prompt_len=round(row["prompt_len"]), response=Lengths.empirical(lengths),
                    ppo_epochs=cfg.algo.epochs, minibatches=cfg.algo.minibatches,
                    dtype=run_dtype(cfg),
                    micro_batch_tokens=cfg.train.micro_batch_tokens,
                    max_batch=cfg.rollout.max_batch, policy_loss=cfg.algo.policy_loss,
                    engine="vllm" if cfg.rollout.engine == "vllm" else "rlloom",
                    partial_tokens=cfg.rollout.partial_tokens, lora_rank=cfg.lora_rank)


def run_roles(cfg: RunConfig) -> tuple[str, ...]:
    """Roles the trainer builds: no reference without a KL term; the reward is a rule verifier
    (not priced) unless a reward model is configured."""
    roles = PRESETS[cfg.algo.name].roles
    return tuple(r for r in roles if r != "reference" or cfg.needs_reference)


@dataclass(frozen=True)
class LoadedRun:
    """What pricing a finished run's steps needs, read once."""
    name: str
    models: dict[str, ModelShape | None]
    plan: Plan  # as the run ran it
    steps: list[tuple[int, Workload, dict[str, float]]]  # step, its workload, measured s


def load_run(run_dir: Path, skip: int = 1) -> LoadedRun:
    """The run's roles, plan and every step after the first `skip` with its workload and
    measured stage seconds."""
    cfg = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if not PRESETS[cfg.algo.name].online:
        raise ValueError(f"{run_dir}: validation covers online presets; {cfg.algo.name} is not")
    if cfg.reward.model_path:
        raise ValueError(f"{run_dir}: runs with a reward model are not validated yet")
    shape = run_shape(run_dir, cfg)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run_dir}: no metrics.jsonl; is it a run directory?")
    steps = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if row["step"] <= skip or row.get("sample_rounds", 1) != 1:
            continue  # warm-up, or a step that generated several rounds (dynamic sampling)
        if "response_lens" not in row:
            raise ValueError(f"{metrics}: no response_lens; the run predates validation "
                             "support, run it again")
        steps.append((row["step"], step_workload(row, cfg),
                      {stage: row[key] for stage, key in STAGES}))
    return LoadedRun(run_dir.name, role_models(shape, run_roles(cfg), critic=critic_shape(cfg)),
                     cfg.plan, steps)


def price_run(run: LoadedRun, hw: Hardware) -> list[StagePoint]:
    """Predicted vs measured seconds per stage of a loaded run's steps on `hw`."""
    points = []
    for step, wl, measured in run.steps:
        p = price(run.plan, run.models, wl, hw)
        predicted = {"generation": p.gen_s, "assessment": p.assess_s, "training": p.train_s}
        points += [StagePoint(run.name, step, stage, predicted[stage], measured[stage])
                   for stage, _ in STAGES]
    return points


def validate_run(run_dir: Path, hw: Hardware, skip: int = 1) -> list[StagePoint]:
    """Predicted vs measured seconds per stage for every step after the first `skip`."""
    return price_run(load_run(run_dir, skip), hw)


def validation_report(run_dirs: list[Path], hw: Hardware, skip: int = 1) -> str:
    points = [pt for d in run_dirs for pt in validate_run(d, hw, skip)]
    if not points:
        raise ValueError(f"no steps after the first {skip} to validate")
    lines = [f"{'run':<16} {'stage':<11} {'steps':>5} {'predicted s':>12} {'measured s':>11} "
             f"{'median |error|':>15}"]
    by_stage: dict[tuple[str, str], list[StagePoint]] = {}
    for pt in points:
        by_stage.setdefault((pt.run, pt.stage), []).append(pt)
    for (run, stage), pts in by_stage.items():
        pred = statistics.mean(p.predicted_s for p in pts)
        meas = statistics.mean(p.measured_s for p in pts)
        err = statistics.median(abs(p.error) for p in pts)
        lines.append(f"{run[:16]:<16} {stage:<11} {len(pts):>5} {pred:>12.3f} {meas:>11.3f} "
                     f"{err:>14.1%}")
    errors = [abs(p.error) for p in points]
    worst = max(by_stage.items(), key=lambda kv: statistics.median(abs(p.error) for p in kv[1]))
    lines.append(f"median |error| over {len(points)} stage measurements: "
                 f"{statistics.median(errors):.1%} (hardware {hw.name}); worst stage: "
                 f"{worst[0][1]} of {worst[0][0]} at "
                 f"{statistics.median(abs(p.error) for p in worst[1]):.1%}")
    if statistics.median(errors) > 0.25 and hw.compute_eff == hw.mem_eff == 1.0:
        lines.append("the hardware file holds raw microbenchmark rates (efficiencies 1.0), "
                     "which cache-hot kernels reach and a run's do not: fit them with `rlloom "
                     "perf calibrate` on one run, then validate on others")
    return "\n".join(lines)


# What `calibrate` searches: compute and memory efficiencies in steps of 0.05, the attention's
# in steps of 0.1 and then 0.05 around the best.
EFFICIENCIES = tuple(round(0.05 * i, 2) for i in range(2, 21))  # 0.10, 0.15, ..., 1.00
ATTENTION = tuple(round(0.1 * i, 1) for i in range(1, 11))
FIELDS = ("compute_eff", "mem_eff", "attn_eff")


def _stage_error(runs: list[LoadedRun], hw: Hardware) -> float:
    """The mean over the runs' stages of each stage's median |error| over its steps: robust to
    an odd step, and every stage counts (the median of all points would ignore the worst
    stage whenever the other two fit)."""
    by: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        for p in price_run(run, hw):
            by.setdefault((p.run, p.stage), []).append(abs(p.error))
    if not by:
        raise ValueError("no steps after the warm-up to compare")
    return statistics.mean(statistics.median(e) for e in by.values())


# the points `calibrate` prices (its progress bar's total): where it starts, the grid, and
# three attention steps around the grid's best
CALIBRATE_POINTS = 1 + len(EFFICIENCIES) ** 2 * len(ATTENTION) + 3


def calibrate(run_dirs: list[Path], hw: Hardware, skip: int = 1,
              tick: Callable[[], None] = lambda: None) -> tuple[Hardware, float, float]:
    """`hw` with the compute, memory and decode-attention efficiencies that minimise the
    runs' stage errors (`_stage_error`); that error before and after. Matmul and memory
    microbenchmarks run hot in cache, unlike a run's kernels, so their rates overstate what
    a run gets by a machine-dependent factor, and a decode step's attention (many small
    products over strided KV rows) streams worse than either. Operator dispatch is not
    fitted: `rlloom bench hw` measures it, and it matches what a run's operators cost (2.0
    us per operator of a one-row decode step against 2.3 measured, on a 2-core host). Fit on
    some runs, validate on others. `tick()` follows each point priced (a progress bar)."""
    runs = [load_run(d, skip) for d in run_dirs]

    def error(values: tuple[float, ...]) -> float:
        tick()
        return _stage_error(runs, replace(hw, **dict(zip(FIELDS, values))))

    before = error(tuple(getattr(hw, f) for f in FIELDS))
    # every point of the grid: the stages' median errors have local minima a descent
    # would stop in
    best = min(itertools.product(EFFICIENCIES, EFFICIENCIES, ATTENTION), key=error)
    c, m, a = best
    after, _, best = min((error(p), p != best, p) for p in
                         ((c, m, round(min(max(a + d, 0.05), 1.0), 2)) for d in (-0.05, 0, 0.05)))
    return replace(hw, **dict(zip(FIELDS, best))), before, after


def calibration_report(run_dirs: list[Path], hw: Hardware, out: Path, skip: int = 1,
                       tick: Callable[[], None] = lambda: None) -> str:
    fitted, before, after = calibrate(run_dirs, hw, skip, tick)
    fitted.save(out)
    names = ", ".join(d.name for d in run_dirs)
    return (f"calibrated on {names}: compute_eff {fitted.compute_eff:.2f}, mem_eff "
            f"{fitted.mem_eff:.2f}, attn_eff {fitted.attn_eff:.2f}; "
            f"mean of their stages' median |error| {before:.1%} -> "
            f"{after:.1%}\nsaved {out}; check it on other runs: rlloom perf validate RUN_DIR...")
