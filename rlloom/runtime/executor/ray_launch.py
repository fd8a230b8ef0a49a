"""`rlloom train` on Ray: validate the run, start or join a cluster, run the step loop
(`loop.StepLoop`) over the Ray executor (`ray_runtime.RayExecutor`) and shut the cluster
down."""
from __future__ import annotations

from pathlib import Path

import torch

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig, dump_config
from rlloom.models.hf_io import load_tokenizer, read_model_config, require_tokenizer_fits
from rlloom.runtime.checkpoint import checkpoint_dirs, checkpoint_step
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.executor.interface import RunOptions, WorkerFailure
from rlloom.runtime.executor.loop import StepLoop
from rlloom.runtime.executor.preflight import preflight
from rlloom.runtime.executor.ray_cluster import Cluster
from rlloom.runtime.executor.ray_plan import check_group_layouts, group_specs
from rlloom.runtime.executor.ray_runtime import RayExecutor
from rlloom.runtime.executor.trainer import check_prompts, new_run_dir
from rlloom.runtime.run_dir import claim, record_resume, rewind


def train_ray(cfg: RunConfig, resume_dir: Path | None = None,
              opts: RunOptions | None = None, overwrite: bool = False,
              changes: dict[str, list] | None = None, rewind_to: int | None = None
              ) -> dict[str, float]:
    """`rlloom train` on Ray: validate, claim the run directory, start or join a cluster,
    run, shut down."""
    opts = opts or RunOptions()
    preflight(cfg, "ray", opts)
    run_dir = resume_dir or new_run_dir(cfg)
    model_path = (Path(cfg.model.path) if cfg.model.path
                  else ensure_default_model(cfg, torch.device("cpu")))  # Ray runs on the CPU
    check_group_layouts(cfg, read_model_config(model_path))
    tokenizer = load_tokenizer(model_path, cfg.data.chat_template)
    require_tokenizer_fits(model_path, tokenizer)
    check_prompts(cfg, tokenizer)
    lock = claim(run_dir, resume_dir is not None, overwrite)
    if rewind_to is not None:
        rewind(run_dir, rewind_to)
    (run_dir / "config.yaml").write_text(dump_config(
        cfg, read_model_config(model_path).describe()))
    if resume_dir is not None:
        record_resume(run_dir, checkpoint_step(run_dir), changes or {})
    try:
        cluster = Cluster(opts, run_dir,
                          sum(opts.cpus(g.name) * g.ranks for g in group_specs(cfg)))
    except BaseException:
        lock.release()
        raise
    if cluster.note:
        print(cluster.note)
    try:
        specs = group_specs(cfg)
        ex = RayExecutor(cfg, opts, model_path, specs, "critic" in PRESETS[cfg.algo.name].roles)
        run = StepLoop(cfg, run_dir, ex, model_path, specs, opts)
        resume = resume_dir is not None and bool(checkpoint_dirs(run_dir))
        return run.run(resume)
    except WorkerFailure as e:
        e.run_dir = run_dir
        raise
    finally:
        cluster.stop()
        lock.release()
