"""`rlloom perf validate`: predict each stage of a finished run's steps with the cost model and
this machine's hardware file, next to what the run measured. `rlloom perf calibrate`: the
factors on the compute, decode attention and assessment dispatch terms that fit some runs best
(jointly over run sizes, with their standard errors), to validate on others.

Each step is priced with its own workload: its number of rollouts, mean prompt length and the
exact response lengths it generated (metrics.jsonl), with the run's plan (placement, layouts,
schedule), in the run's dtype. Measured times are the run's stage spans (the same spans as
trace.json, with reward scoring counted under assessment as the runtime logs it).
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from rlloom.algos.presets import PRESETS
from rlloom.algos.rollout_correction import recomputes_behaviour
from rlloom.config import RunConfig
from rlloom.config_sections import ModelSection
from rlloom.perf.model.compose import group_ranks, price, role_models
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


CHAINED = ("generation", "assessment", "training", "weight_sync")


def call_gaps(run_dir: Path, ranks: dict[str, int], skip: int = 1) -> list[float]:
    """From the run's trace.json, the gap in front of each stage span after the first `skip`
    steps (its start minus the latest end of any span before it: the driver reaching the
    stage once what it waited for was done) per rank of the group it ran on (`ranks`), the
    driver's round trip per rank called (`Hardware.call_s`). A run without a trace has none."""
    trace = run_dir / "trace.json"
    if not trace.is_file():
        return []
    spans = sorted({(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, e["name"], e["pid"],
                     e["args"]["step"])
                    for e in json.loads(trace.read_text())["traceEvents"]
                    if e.get("ph") == "X" and "step" in e.get("args", {})})
    gaps, latest = [], None
    for start, end, name, group, step in spans:
        if latest is not None and name in CHAINED and step > skip and start >= latest:
            gaps.append((start - latest) / ranks[group])
        latest = end if latest is None else max(latest, end)
    return gaps


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


# What `calibrate` fits: a factor on the priced time of each term below, jointly over the runs
# given (several run sizes tell apart the terms one size confounds). Compute: the file's
# compute and memory efficiencies together (their ratio stays the microbenchmarks' or the
# catalogue's): a run's kernels fall below both by one factor, a level that depends on the
# host and its neighbours. Attention: the decode attention's efficiency, many small
# per-(row, head) products over strided cache rows, a rate no microbenchmark gives. Assessment
# dispatch: the scoring stage's host time per operator, which `bench hw` measures on a model
# too small to compute and runs of real sizes pay less of. Not fitted, measured held out over
# three sets of three run sizes (docs/performance-model.md, section 10): generation's
# dispatch trades against attention (worst held-out stage 63%), training's against compute
# (worst 23%, against 16% without it).
FITTED = ("compute", "attention", "assessment dispatch")
MAX_ITERATIONS = 10
CALIBRATE_POINTS = 1 + MAX_ITERATIONS  # the start and each iteration (progress bar)
_PROBE = 0.05  # log-factor step of the numerical derivatives
LIMIT = math.log(20)  # the largest log factor fitted
WIDE = 0.5  # a factor known worse than exp(0.5) = x1.65 either way is not determined


def _stage_error(runs: list[LoadedRun], hw: Hardware) -> float:
    """The mean over the runs' priced stages of |error| of the stage's mean time
    (`stage_errors`): every stage counts alike; one the plan does not price (reward scoring
    without a model, predicted 0) has no error of the model's to count."""
    points = [p for run in runs for p in price_run(run, hw)]
    if not points:
        raise ValueError("no steps after the warm-up to compare")
    errors = [abs(e) for e in stage_errors(points).values() if e > -1]
    return statistics.mean(errors) if errors else 0.0


def _factored(hw: Hardware, log_factors: Sequence[float]) -> Hardware:
    """`hw` with each `FITTED` term's priced time times exp(its log factor)."""
    compute, attention, assessment = (math.exp(x) for x in log_factors)
    return replace(hw, compute_eff=_digits(hw.compute_eff / compute),
                   mem_eff=_digits(hw.mem_eff / compute),
                   attn_eff=_digits(hw.attn_eff / attention),
                   assess_launch_s=_digits(hw.stage_launch_s("assessment") * assessment))


def _digits(value: float) -> float:
    return float(f"{value:.4g}")


def _log_errors(runs: list[LoadedRun], hw: Hardware) -> list[float]:
    """log(predicted / measured) of each run's stage mean (`stage_errors`), in a fixed order;
    a stage the plan does not price (predicted 0) has nothing to fit."""
    errors = stage_errors([p for run in runs for p in price_run(run, hw)])
    return [math.log1p(e) for _, e in sorted(errors.items()) if e > -1]


@dataclass(frozen=True)
class Fit:
    hardware: Hardware  # the input file with the fitted terms
    before: float  # the runs' stage error (`_stage_error`) with the input file
    after: float  # ... with the fitted one
    factors: dict[str, float]  # `FITTED` term -> its factor on the priced time
    spread: dict[str, float]  # ... -> one standard error of its log (inf: not determined)


def calibrate(run_dirs: list[Path], hw: Hardware, skip: int = 1,
              tick: Callable[[], None] = lambda: None) -> Fit:
    """The factors on the `FITTED` terms that fit the runs' stage means best (least squares
    of their log errors, Gauss-Newton), with their standard errors, and the driver's round
    trip per stage call measured from their traces (the median of `call_gaps`). Fit on runs
    of several sizes, validate on others. `tick()` follows the start and each iteration."""
    runs = [load_run(d, skip) for d in run_dirs]
    gaps = [g for d, run in zip(run_dirs, runs)
            for g in call_gaps(d, group_ranks(run.plan, run.models), skip)]
    if gaps:
        hw = replace(hw, call_s=_digits(statistics.median(gaps)))
    return fit_runs(runs, hw, tick)


def fit_runs(runs: list[LoadedRun], hw: Hardware, tick: Callable[[], None] = lambda: None
             ) -> Fit:
    """`calibrate` on runs already loaded (a running run's recent steps, say). A direction
    the runs do not determine (fewer stages than terms, or collinear ones) is left where the
    file puts it (the minimum-norm step) and reported as not determined."""
    import numpy as np
    before = _stage_error(runs, hw)
    x = np.zeros(len(FITTED))
    r = np.array(_log_errors(runs, hw))
    if not len(r):
        raise ValueError("no stage of these runs is priced: nothing to calibrate")
    tick()
    jac = np.zeros((len(r), len(FITTED)))
    for iteration in range(MAX_ITERATIONS):
        for k in range(len(FITTED)):
            probe = x.copy()
            probe[k] += _PROBE
            jac[:, k] = (np.array(_log_errors(runs, _factored(hw, probe))) - r) / _PROBE
        # a factor past x20 either way is no efficiency the host has: the runs do not say
        step = np.clip(x + np.linalg.lstsq(jac, -r, rcond=1e-3)[0], -LIMIT, LIMIT) - x
        for shrink in (1.0, 0.5, 0.25, 0.125):  # a step that makes the fit worse is cut
            trial = np.array(_log_errors(runs, _factored(hw, x + shrink * step)))
            if trial @ trial <= r @ r:
                break
        x, r = x + shrink * step, trial
        tick()
        if np.max(np.abs(shrink * step)) < 1e-3:
            for _ in range(MAX_ITERATIONS - 1 - iteration):
                tick()
            break
    # the residuals' variance per degree of freedom, at least the noise's between identical
    # runs' stage means (about 8% here), so that an exact fit does not claim certainty
    _, singular, directions = np.linalg.svd(jac)
    rank = int(np.sum(singular > 1e-3))
    dof = len(r) - rank
    var = max(float(r @ r) / dof if dof > 0 else 0.0, 0.08 ** 2)
    cov = var * np.linalg.pinv(jac.T @ jac, rcond=1e-6)
    # a term outside the directions the runs determine has no finite error
    seen = np.sum(directions[:rank] ** 2, axis=0)
    spread = {name: math.sqrt(max(cov[k, k], 0.0)) if seen[k] > 0.99 else math.inf
              for k, name in enumerate(FITTED)}
    fitted = _factored(hw, x)
    after = _stage_error(runs, fitted)
    # what the fit leaves unexplained widens every price made with it (`model.interval`)
    fitted = replace(fitted, extra={**fitted.extra, "calibration_error": round(after, 4)})
    return Fit(fitted, before, after, dict(zip(FITTED, (float(math.exp(v)) for v in x))),
               spread)


def uncertainty(spread: float) -> str:
    """A fitted factor's standard error (of its log, `Fit.spread`) as a person reads it."""
    if not math.isfinite(spread):
        return "not determined"
    if spread > WIDE:
        return f"+-over {math.expm1(WIDE):.0%}"
    return f"+-{math.expm1(spread):.0%}"


def calibration_report(run_dirs: list[Path], hw: Hardware, out: Path, skip: int = 1,
                       tick: Callable[[], None] = lambda: None) -> str:
    fit = calibrate(run_dirs, hw, skip, tick)
    fitted = fit.hardware
    fitted.save(out)
    names = ", ".join(d.name for d in run_dirs)
    terms = ", ".join(f"{name} x{fit.factors[name]:.2f} ({uncertainty(fit.spread[name])})"
                      for name in FITTED)
    lines = [f"calibrated on {names}: {terms} of the priced time; compute_eff "
             f"{fitted.compute_eff:.2f}, mem_eff {fitted.mem_eff:.2f}, attn_eff "
             f"{fitted.attn_eff:.2f}, assessment {fitted.assess_launch_s * 1e6:.1f} us per "
             f"operator, {fitted.call_s * 1e3:.1f} ms per stage call and rank; mean "
             f"of their stages' |error| {fit.before:.1%} -> {fit.after:.1%}"]
    if max(fitted.compute_eff, fitted.mem_eff) > 1.0:
        lines.append(f"the runs computed faster than the file's rates allow (compute_eff "
                     f"{fitted.compute_eff:.2f}, mem_eff {fitted.mem_eff:.2f}, above 1): the "
                     "file was likely measured while other work ran; measure again with "
                     "`rlloom bench hw` while nothing else runs, then calibrate")
    loose = [name for name in FITTED if fit.spread[name] > WIDE]
    if loose:
        lines.append(f"{' and '.join(loose)} {'is' if len(loose) == 1 else 'are'} not "
                     "determined by these runs (one standard error beyond x1.65): fit on runs "
                     "of several sizes, e.g. 16 x 4 and 64 x 8 rollouts a step, whose stages "
                     "weigh the terms differently (attention needs many rows decoding at once)")
    lines.append(f"saved {out}; check it on other runs: rlloom perf validate RUN_DIR...")
    return "\n".join(lines)
