"""`rlloom perf validate`: predict each stage of a finished run's steps with the cost model and
this machine's hardware file, next to what the run measured. `rlloom perf calibrate`: the
scale of the compute and memory efficiencies and the decode attention's efficiency that fit
some runs best, to validate on others.

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
from rlloom.algos.rollout_correction import recomputes_behaviour
from rlloom.config import RunConfig
from rlloom.config_sections import ModelSection
from rlloom.perf.model.compose import price, role_models
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.interval import hardware_error
from rlloom.perf.model.shapes import ModelShape, model_shape
from rlloom.perf.model.workload import Lengths, Workload
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


def run_shape(run_dir: Path, model: ModelSection) -> ModelShape:
    """The policy's shape from the run's exported model, or from the model it started from."""
    for candidate in (run_dir / "final" / "config.json",
                      Path(model.path or "") / "config.json"):
        if candidate.is_file():
            return ModelShape.from_hf_config(json.loads(candidate.read_text()), "policy")
    raise ValueError(f"{run_dir}: no final/config.json and no model.path config.json; "
                     "validate a finished run")


def critic_shape(model: ModelSection) -> ModelShape | None:
    """The critic's shape when it starts from a checkpoint of its own (`model.critic_path`)."""
    return model_shape(model.critic_path) if model.critic_path else None


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
                    partial_tokens=cfg.rollout.partial_tokens, lora_rank=cfg.lora_rank,
                    recompute_logprobs=recomputes_behaviour(cfg.rollout.engine,
                                                            cfg.algo.rollout_is))


def run_roles(cfg: RunConfig) -> tuple[str, ...]:
    """Roles the trainer builds: no reference without a KL term; the reward is a rule verifier
    (not priced) unless a reward model is configured."""
    roles = PRESETS[cfg.algo.name].roles
    return tuple(r for r in roles if r != "reference" or cfg.needs_reference)


def measured_step(row: dict, cfg: RunConfig) -> tuple[int, Workload, dict[str, float]]:
    """A metrics row's step, its workload and its measured seconds per stage."""
    return row["step"], step_workload(row, cfg), {stage: row[key] for stage, key in STAGES}


@dataclass(frozen=True)
class LoadedRun:
    """What pricing a finished run's steps needs, read once."""
    name: str
    models: dict[str, ModelShape | None]
    plan: Plan  # as the run ran it
    steps: list[tuple[int, Workload, dict[str, float]]]  # step, its workload, measured s
    algo: str  # the preset it trained with


def load_run(run_dir: Path, skip: int = 1) -> LoadedRun:
    """The run's roles, plan and every step after the first `skip` with its workload and
    measured stage seconds."""
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir}: no config.yaml; give the directory `rlloom train` wrote "
                         "(run_dir)")
    cfg = RunConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if not PRESETS[cfg.algo.name].online:
        raise ValueError(f"{run_dir}: validation covers online presets; {cfg.algo.name} is not")
    if cfg.reward.model_path:
        raise ValueError(f"{run_dir}: runs with a reward model are not validated yet")
    shape = run_shape(run_dir, cfg.model)
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
        steps.append(measured_step(row, cfg))
    models = role_models(shape, run_roles(cfg), critic=critic_shape(cfg.model))
    return LoadedRun(run_dir.name, models, cfg.plan, steps, cfg.algo.name)


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


def _by_stage(points: list[StagePoint]) -> dict[tuple[str, str], list[StagePoint]]:
    by: dict[tuple[str, str], list[StagePoint]] = {}
    for p in points:
        by.setdefault((p.run, p.stage), []).append(p)
    return by


def stage_errors(points: list[StagePoint]) -> dict[tuple[str, str], float]:
    """Signed relative error of each run's stage, the mean predicted against the mean measured
    over its steps: a step's own time carries the host's step-to-step noise (identical runs
    differ by a median 13% per step on a shared 2-core machine), which averaging over the
    steps takes out, and what the model predicts is the stage's expected time."""
    return {k: sum(p.predicted_s for p in pts) / sum(p.measured_s for p in pts) - 1
            for k, pts in _by_stage(points).items()}


def validation_report(run_dirs: list[Path], hw: Hardware, skip: int = 1) -> str:
    points = [pt for d in run_dirs for pt in validate_run(d, hw, skip)]
    if not points:
        raise ValueError(f"no steps after the first {skip} to validate")
    # each run's lengths are the measured ones: only the hardware file's error widens a price
    h = hardware_error(hw)
    lines = [f"{'run':<16} {'stage':<11} {'steps':>5} {'predicted s':>12} {'range s':>15} "
             f"{'measured s':>11} {'error':>7} {'median |step error|':>20}"]
    errors = stage_errors(points)
    inside = 0
    for (run, stage), pts in _by_stage(points).items():
        pred = statistics.mean(p.predicted_s for p in pts)
        meas = statistics.mean(p.measured_s for p in pts)
        step_err = statistics.median(abs(p.error) for p in pts)
        low, high = pred * (1 - h), pred * (1 + h)
        inside += low <= meas <= high
        lines.append(f"{run[:16]:<16} {stage:<11} {len(pts):>5} {pred:>12.3f} "
                     f"{f'{low:.3f}-{high:.3f}':>15} {meas:>11.3f} "
                     f"{errors[run, stage]:>+7.1%} {step_err:>19.1%}")
    median = statistics.median(abs(e) for e in errors.values())
    (run, stage), worst = max(errors.items(), key=lambda kv: abs(kv[1]))
    lines.append(f"median per-stage |error| over {len(errors)} run stages: {median:.1%} "
                 f"(hardware {hw.name}); worst: {stage} of {run} at {worst:+.1%}; per step, "
                 f"median over {len(points)} stage measurements: "
                 f"{statistics.median(abs(p.error) for p in points):.1%}")
    lines.append(f"measured within the predicted range (+-{h:.1%}: the hardware file's measured "
                 f"spread and calibration error): {inside} of {len(errors)} run stages")
    if hw.dispatch_overlap == 0 and not (hw.assess_launch_s and hw.train_launch_s):
        lines.append("the hardware file prices assessment and training at a plain forward's "
                     "dispatch: a CPU file from an older `rlloom bench hw`, which did not "
                     "measure the runtime's stages; run `rlloom bench hw` again")
    if median > 0.25 and hw.compute_eff == hw.mem_eff == 1.0:
        lines.append("the hardware file holds raw microbenchmark rates (efficiencies 1.0), "
                     "which cache-hot kernels reach and a run's do not: fit them with `rlloom "
                     "perf calibrate` on one run, then validate on others")
    return "\n".join(lines)


# What `calibrate` searches: one scale of the file's compute and memory efficiencies (the
# larger of the two lands on 0.10, 0.15, ..., 1.00) and the decode attention's, 0.05 ... 1.00.
SCALES = tuple(round(0.05 * i, 2) for i in range(2, 21))
ATTENTION = tuple(round(0.05 * i, 2) for i in range(1, 21))
CALIBRATE_POINTS = 1 + len(SCALES) * len(ATTENTION)  # the start and the grid (progress bar)


def _stage_error(runs: list[LoadedRun], hw: Hardware) -> float:
    """The mean over the runs' stages of |error| of the stage's mean time (`stage_errors`):
    every stage counts alike."""
    points = [p for run in runs for p in price_run(run, hw)]
    if not points:
        raise ValueError("no steps after the warm-up to compare")
    return statistics.mean(abs(e) for e in stage_errors(points).values())


def _scaled(hw: Hardware, scale: float, attn: float) -> Hardware:
    top = max(hw.compute_eff, hw.mem_eff)
    return replace(hw, compute_eff=round(scale * hw.compute_eff / top, 4),
                   mem_eff=round(scale * hw.mem_eff / top, 4), attn_eff=attn)


TIE = 0.01  # errors within one point of the best fit the runs as well


@dataclass(frozen=True)
class Fit:
    hardware: Hardware  # the input file with the fitted efficiencies
    before: float  # the runs' stage error (`_stage_error`) with the input file
    after: float  # ... with the fitted one
    attn_range: tuple[float, float]  # attn_eff values whose best error is within TIE


def calibrate(run_dirs: list[Path], hw: Hardware, skip: int = 1,
              tick: Callable[[], None] = lambda: None) -> Fit:
    """The efficiencies that minimise the runs' stage errors (`_stage_error`). Two numbers
    are fitted. One scale of the compute and memory efficiencies together: the
    microbenchmarks (or the catalogue) fix their ratio, and a run's kernels fall below both
    by the same factor, a level that depends on the host and its neighbours (two free
    efficiencies trade against each other on one run and extrapolate to other batch sizes
    worse, measured). And the decode attention's efficiency: many small per-(row, head)
    products over strided cache rows, a rate no microbenchmark gives. Operator dispatch is
    not fitted: `rlloom bench hw` measures it, and with it the raw rates price the engine's
    decode steps of 64, 256 and 512 rows within 6-16% (docs/performance-model.md, section
    10). Fit on some runs, validate on others. `tick()` follows each point priced."""
    return fit_runs([load_run(d, skip) for d in run_dirs], hw, tick)


def fit_runs(runs: list[LoadedRun], hw: Hardware, tick: Callable[[], None] = lambda: None
             ) -> Fit:
    """`calibrate` on runs already loaded (a running run's recent steps, say)."""
    def error(point: tuple[float, float]) -> float:
        tick()
        return _stage_error(runs, _scaled(hw, *point))

    tick()
    before = _stage_error(runs, hw)
    errors = {point: error(point) for point in itertools.product(SCALES, ATTENTION)}
    best = min(errors, key=errors.__getitem__)
    ties = [a for (_, a), e in errors.items() if e <= errors[best] + TIE]
    fitted = _scaled(hw, *best)
    # what the fit leaves unexplained widens every price made with it (`model.interval`)
    fitted = replace(fitted, extra={**fitted.extra, "calibration_error": round(errors[best], 4)})
    return Fit(fitted, before, errors[best], (min(ties), max(ties)))


def calibration_report(run_dirs: list[Path], hw: Hardware, out: Path, skip: int = 1,
                       tick: Callable[[], None] = lambda: None) -> str:
    fit = calibrate(run_dirs, hw, skip, tick)
    fitted = fit.hardware
    fitted.save(out)
    names = ", ".join(d.name for d in run_dirs)
    lines = [f"calibrated on {names}: compute_eff {fitted.compute_eff:.2f}, mem_eff "
             f"{fitted.mem_eff:.2f}, attn_eff {fitted.attn_eff:.2f}; mean of their stages' "
             f"|error| {fit.before:.1%} -> {fit.after:.1%}"]
    low, high = fit.attn_range
    if high - low >= 0.25:
        lines.append(f"attn_eff fits as well anywhere from {low:.2f} to {high:.2f} (errors "
                     f"within {TIE * 100:.0f} point of the best): these runs decode too few rows "
                     "at once to tell the attention's cost; calibrate on a run with more "
                     "rollouts per step")
    lines.append(f"saved {out}; check it on other runs: rlloom perf validate RUN_DIR...")
    return "\n".join(lines)
