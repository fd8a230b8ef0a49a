"""rlloom from Python: the same run as `rlloom train`, with your reward functions as callables,
your datasets in memory and callbacks on each step.

    import rlloom
    result = rlloom.train(overrides={"train.steps": 20},
                          reward_funcs=[my_reward],          # callables or "file.py:fn"
                          train_dataset=rows,                # list[dict], datasets.Dataset, path
                          callbacks=[lambda row: print(row["reward"])])
    result.metrics[-1], result.eval_after, result.final_model

The CLI's `rlloom train` is `prepare` + `launch` below. Callables and in-memory data are
written once, content-addressed, under the cache (`RLLOOM_CACHE`, default ~/.cache/rlloom):
reward functions pickled by value with cloudpickle (so a function defined in a script or a
notebook reaches Ray workers too), rows as jsonl. The run directory then names only files, so
`rlloom train --resume` continues a run started from Python.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlloom.config import ConfigError, RunConfig, apply_override, load_config, validate_config
from rlloom.runtime.outputs.files import write_atomic

Callback = Callable[[dict[str, Any]], Any]


@dataclass
class RunResult:
    """What a finished run left: its directory, its metrics rows, the held-out score before
    and after RL (None without held-out problems) and the trained model's directory."""
    run_dir: Path
    metrics: list[dict[str, Any]]
    eval_before: float | None
    eval_after: float | None
    final_model: Path
    restarts: int = 0


@dataclass
class Prepared:
    """A validated run: its config, and for `--resume` the run directory, the checkpoint step
    it names (if any) and what its overrides change."""
    cfg: RunConfig
    resume: Path | None = None
    rewind: int | None = None
    changes: dict[str, list] = field(default_factory=dict)


def _cache() -> Path:
    from rlloom.runtime.default_model import cache_root
    return cache_root() / "api"


def _stored(data: bytes, folder: str, name: str, suffix: str) -> Path:
    """`data` under the cache, named by its content (written once, atomically)."""
    path = _cache() / folder / f"{name}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    if not path.exists():  # processes storing the same rows at once each write whole
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)
    return path


def _dataset_file(dataset: Any, name: str) -> str:
    """A path as given; rows (a list of dicts, a `datasets.Dataset`) stored as jsonl."""
    if isinstance(dataset, (str, Path)):
        return str(Path(dataset).expanduser().resolve())
    rows = dataset.to_list() if hasattr(dataset, "to_list") else dataset
    if not isinstance(rows, Iterable) or isinstance(rows, (dict, bytes)):
        raise ConfigError(f"{name} must be a path, a list of dicts or a datasets.Dataset, not "
                          f"{type(dataset).__name__}")
    rows = list(rows)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{name} must hold at least one row, each a dict of columns")
    try:
        text = "".join(json.dumps(r) + "\n" for r in rows)
    except TypeError as e:
        raise ConfigError(f"{name}: a row is not JSON data ({e})") from None
    return str(_stored(text.encode(), "datasets", name, ".jsonl"))


def _reward_spec(fn: Any) -> str:
    """A spec as given; a callable pickled by value and named by its __name__."""
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", "")
    if not callable(fn) or not name.isidentifier():
        raise ConfigError(f"reward function {fn!r}: give a named function (def or "
                          "functools.wraps), or 'file.py:function'")
    import cloudpickle
    module = sys.modules.get(getattr(fn, "__module__", ""))
    # by value even when its module is importable here: a worker (or a later --resume) may
    # not have that module (a test file, a notebook's helper) on its path
    by_value = module is not None and module.__name__ != "__main__" and \
        not module.__name__.startswith(("rlloom.", "builtins"))
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        data = cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
    return f"{_stored(data, 'functions', name, '.pkl')}:{name}"


def _overrides(overrides: dict[str, Any] | list[str] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):  # JSON is YAML: values keep their types
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


def prepare(config: str | Path | RunConfig | Any = None,
            overrides: dict[str, Any] | list[str] | None = None, *,
            reward_funcs: list[Any] | None = None, train_dataset: Any = None,
            eval_dataset: Any = None, resume: str | Path | None = None,
            overwrite: bool = False, accept_changed_data: bool = False) -> Prepared:
    """The run's validated config; for `resume`, what it continues and changes (refused
    before anything is written when a change cannot apply, and when a data file's contents
    changed unless `accept_changed_data`). `config` may be TRL's GRPOConfig or DPOConfig: the
    fields it sets, in TRL's meaning (rlloom/trl_configs.py)."""
    extra = _overrides(overrides)
    if reward_funcs is not None:
        extra.append(f"reward.functions={json.dumps([_reward_spec(f) for f in reward_funcs])}")
    if train_dataset is not None:
        extra.append(f"data.prompt_file={json.dumps(_dataset_file(train_dataset, 'train'))}")
    if eval_dataset is not None:
        extra.append(f"data.eval_file={json.dumps(_dataset_file(eval_dataset, 'eval'))}")
    rewind = None
    run = Path(resume) if resume is not None else None
    if run is not None:
        if config is not None:
            raise ConfigError("--resume reads the run's own config.yaml; pass only overrides")
        if overwrite:
            raise ConfigError("--resume continues a run and --overwrite replaces it: pass one")
        if run.parent.name == "checkpoints":  # RUN_DIR/checkpoints/step_N: from that one
            from rlloom.runtime.run_dir import checkpoint_of
            rewind, run = checkpoint_of(run), run.parent.parent
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--resume {run}: no config.yaml there; is it a run directory?")
        config = run / "config.yaml"
    from rlloom.trl_configs import fill_defaults, is_trl_config, rl_config
    if isinstance(config, RunConfig) or is_trl_config(config):
        data, trl_defaults = ((config.model_dump(mode="json"), {})
                              if isinstance(config, RunConfig) else rl_config(config))
        for item in extra:
            apply_override(data, item)
        fill_defaults(data, trl_defaults)
        cfg = validate_config(data, f"the {type(config).__name__} given + overrides")
    else:
        cfg = load_config(config, extra)
    if run is None:
        return Prepared(cfg)
    from rlloom.runtime.run_dir import changed_inputs, resume_changes, saved_config
    saved = saved_config(run, rewind)
    changes = resume_changes(saved, cfg, run)
    data = changed_inputs(run, saved, cfg)
    if data and not accept_changed_data:
        raise ConfigError(
            f"--resume {run}: {', '.join(k.removesuffix(' (contents)') for k in data)} changed "
            "since the run started (its contents' sha256 differ), so the held-out scores "
            "before and after would compare different sets; restore the file, start a new run, "
            "or pass --accept-changed-data to go on with it (recorded in resumes.jsonl)")
    return Prepared(cfg, run, rewind, {**changes, **data})


def launch(run: Prepared, *, overwrite: bool = False, ray: bool = False,
           options: Any = None) -> RunResult:
    """Runs a prepared run in this process (and its torchrun peers) or on Ray (`ray`,
    `options.address`, or a plan that needs it); `options` is a `RunOptions`."""
    from rlloom.runtime.executor import groups
    from rlloom.runtime.executor.interface import RunOptions
    from rlloom.runtime.executor.launch import new_run_dir, train
    from rlloom.runtime.outputs.metrics import MetricsLog
    cfg, opts = run.cfg, options or RunOptions()
    if run.resume is None and cfg.run_dir is None:  # named here, so the result can say where
        cfg = cfg.model_copy(update={"run_dir": str(new_run_dir(cfg))})
    run_dir = run.resume or Path(cfg.run_dir)
    if ray or opts.address or groups.needs_ray(cfg):
        try:
            import ray as _  # noqa: F401
        except ImportError:
            raise ConfigError("this run needs the Ray runtime (plan.placement="
                              f"{cfg.plan.placement}, plan.schedule={cfg.plan.schedule}); "
                              "install it with pip install 'rlloom[ray]'") from None
        if "*" in opts.group_cpus:
            opts.group_cpus = {g.name: opts.group_cpus["*"] for g in groups.group_specs(cfg)}
        ray = True
    summary = train(cfg, run.resume, opts, overwrite=overwrite, changes=run.changes,
                    rewind_to=run.rewind, ray=ray)
    score = (lambda v: None if v != v else v)  # NaN: no held-out problems
    return RunResult(run_dir, MetricsLog(run_dir / "metrics.jsonl").rows(),
                     score(summary["eval_before"]), score(summary["eval_after"]),
                     run_dir / "final", int(summary.get("restarts", 0)))


def train(config: str | Path | RunConfig | Any = None,
          overrides: dict[str, Any] | list[str] | None = None, *,
          reward_funcs: list[Any] | None = None, train_dataset: Any = None,
          eval_dataset: Any = None, callbacks: list[Callback] | None = None,
          resume: str | Path | None = None, overwrite: bool = False, ray: bool = False,
          options: Any = None, accept_changed_data: bool = False) -> RunResult:
    """Train as `rlloom train` does. `config`: a YAML path, a RunConfig, TRL's GRPOConfig or
    DPOConfig, or None (the built-in default); `overrides`: {"train.steps": 20} or ["train.steps=20"];
    `reward_funcs`: callables with TRL's signature or "file.py:fn" specs; `train_dataset` /
    `eval_dataset`: a path, a list of row dicts or a datasets.Dataset; `callbacks`: called
    with each step's metrics row on the driver, a callback returning False stops the run
    after that step (checkpointed, final model written); `resume`: a run directory or one of
    its checkpoints (`accept_changed_data`: although a data file's contents changed);
    `options`: a RunOptions (Ray address, restarts, ...)."""
    from rlloom.runtime.executor.interface import RunOptions
    run = prepare(config, overrides, reward_funcs=reward_funcs, train_dataset=train_dataset,
                  eval_dataset=eval_dataset, resume=resume, overwrite=overwrite,
                  accept_changed_data=accept_changed_data)
    opts = options or RunOptions()
    if callbacks:
        opts.callbacks = (*opts.callbacks, *callbacks)
    return launch(run, overwrite=overwrite, ray=ray, options=opts)


def evaluate(checkpoint: str | Path, config: str | Path | RunConfig | None = None,
             overrides: dict[str, Any] | list[str] | None = None, *,
             reward_funcs: list[Any] | None = None, eval_dataset: Any = None
             ) -> dict[str, Any]:
    """Score a Hugging Face checkpoint as `rlloom eval` does: `eval_dataset` (else the
    config's `data.eval_file`, or its task's held-out problems) with the config's reward
    terms and `reward_funcs`; `eval.n_samples` > 1 adds pass@k. Returns the report: `score`
    (what `score_name` says it is), `eval/<term>`, `eval_accuracy` where a verifier defines
    it, the settings it ran with, and `samples`: per problem its prompt, answer, source row,
    each response with its reward terms, how many passed and its pass@k."""
    from rlloom.runtime.stages.evaluate import evaluate_checkpoint
    extra = [f"model.path={json.dumps(str(checkpoint))}", *_overrides(overrides)]
    run = prepare(config, extra, reward_funcs=reward_funcs, eval_dataset=eval_dataset)
    return evaluate_checkpoint(run.cfg)


def sft(config: str | Path | RunConfig | Any = None,
        overrides: dict[str, Any] | list[str] | None = None, *, out: str | Path | None = None,
        train_dataset: Any = None, overwrite: bool = False) -> Path:
    """Supervised warm start as `rlloom sft` does: `config` a YAML path, a RunConfig, TRL's
    SFTConfig (its learning rate, steps, batch and output_dir) or None; `train_dataset`
    rows with a `solution` (or `messages` ending with the assistant's turn). Returns the saved
    model's directory, `out` (refused when it holds something, unless `overwrite`)."""
    from rlloom.runtime.default_model import warm_start
    from rlloom.runtime.outputs.files import fresh_output, naming
    from rlloom.trl_configs import is_trl_config, sft_overrides
    extra = _overrides(overrides)
    if is_trl_config(config):
        out = out if out is not None else config.output_dir
        extra, config = [*sft_overrides(config), *extra], None
    if out is None:
        raise ConfigError("rlloom.sft(out=...): give the directory to save the model to")
    if train_dataset is not None:
        extra.append(f"data.prompt_file={json.dumps(_dataset_file(train_dataset, 'train'))}")
    if isinstance(config, RunConfig):
        data = config.model_dump(mode="json")
        for item in extra:
            apply_override(data, item)
        cfg = validate_config(data, "the RunConfig given + overrides", sft=True)
    else:
        cfg = load_config(config, extra, sft=True)
    out = Path(out)
    fresh_output(out, overwrite)
    with naming(out):
        return warm_start(cfg, out)
