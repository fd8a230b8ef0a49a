"""`rlloom train` without Ray: the executor's stage hosts on one rank (this process) or on a
torchrun world, run step by step (Generation -> Assessment -> Training), with held-out
evaluation, metrics, a trace, checkpoints and resume."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.contracts import algo_problems
from rlloom.algos.kl import kl_controller
from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig, dump_config
from rlloom.data.preferences import read_preference_file
from rlloom.data.prompts import DataError, PromptStream, load_prompt_sets
from rlloom.models.hf_io import load_tokenizer, read_model_config
from rlloom.rewards.sandbox import SandboxPool
from rlloom.runtime.checkpoint import checkpoint_dirs, load_latest
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.device import compute_precision, resolve_device
from rlloom.runtime.executor.distributed import distributed_problems, join_torchrun
from rlloom.runtime.executor.hosts import (
    AssessmentHost,
    GenerationHost,
    SpanLog,
    TrainingHost,
    save_final,
    step_row,
)
from rlloom.runtime.executor.ranks import RankGroup, leave_world
from rlloom.runtime.executor.ray_plan import check_group_layouts, group_specs, world_size
from rlloom.runtime.outputs.metrics import MetricsLog
from rlloom.runtime.outputs.plots import plot_run
from rlloom.runtime.outputs.progress import progress_bar
from rlloom.runtime.outputs.tracing import Tracer
from rlloom.runtime.stages.batch import encode
from rlloom.runtime.stages.offline import preference_step

PROGRESS_KEYS = ("reward", "accuracy", "pref_accuracy", "kl", "eval_accuracy", "step_s")


def check_runnable(cfg: RunConfig, world: int = 1) -> None:
    """Refuse, before any work, what this runtime cannot execute."""
    if world > 1:
        problems = distributed_problems(cfg, world)
        if problems:
            raise ConfigError(f"this plan cannot run under torchrun with {world} processes: "
                              + "; ".join(problems))
    else:
        problems = cfg.plan.single_process_problems()
        if problems:
            raise ConfigError("the single-process runtime cannot run this plan: " +
                              "; ".join(problems) + " (launch it with torchrun "
                              "--nproc_per_node N -m rlloom train, or use the Ray runtime)")
    problems = algo_problems(cfg)
    if problems:
        raise ConfigError("this algorithm cannot run: " + "; ".join(problems))


def check_prompt_lengths(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse, before any work, prompts longer than `data.max_prompt_tokens`."""
    d = cfg.data
    sets = load_prompt_sets(d.task, d.difficulty, cfg.seed, d.train_size, d.eval_size,
                            d.prompt_file, d.eval_fraction, d.columns)
    problems, limit = sets.train + sets.eval, d.max_prompt_tokens
    source = d.prompt_file or f"built-in task {d.task}"
    lengths = [len(ids) for ids in encode(tokenizer, [p.prompt for p in problems])]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if too_long:
        i, n = too_long[0]
        where = problems[i].source or f"{source} prompt #{i}"
        raise DataError(f"{where}: prompt has {n} tokens, more than data.max_prompt_tokens="
                        f"{limit} ({len(too_long)} prompts of {source} do); raise "
                        "data.max_prompt_tokens or shorten the prompts")


def new_run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    name = [time.strftime("%Y%m%d-%H%M%S")]
    if world_size() > 1:  # every process must write where rank 0 does
        join_torchrun(cfg.train.device)
        torch.distributed.broadcast_object_list(name, src=0)
    return Path("runs") / name[0]


class Trainer:
    """The executor's loop in this process (one rank) or in a torchrun world (one colocated
    group of its processes): the hosts of `hosts.py` build every model and run every stage,
    as they do on a Ray group; this loop runs them in order (the sync schedule)."""

    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        world = world_size()
        check_runnable(cfg, world)
        self.cfg, self.run_dir = cfg, run_dir
        self.preset = PRESETS[cfg.algo.name]
        # every model lives here, and every tensor that meets their outputs
        self.ranks = (join_torchrun(cfg.train.device) if world > 1
                      else RankGroup(device=resolve_device(cfg.train.device)))
        self.device = self.ranks.device
        # processes on one machine share its cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local))
        self.model_path = Path(cfg.model.path) if cfg.model.path else self._default_model()
        tokenizer = load_tokenizer(self.model_path)
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise DataError(f"the tokenizer in {self.model_path} needs an EOS and a pad token")
        if world > 1:
            check_group_layouts(cfg, read_model_config(self.model_path))
        check_prompt_lengths(cfg, tokenizer)
        d = cfg.data
        self.pool = (SandboxPool(cfg.reward.sandbox_workers) if cfg.data.task == "code"
                     else None)
        self.spans = SpanLog("local", keep=self.ranks.main)
        [group] = group_specs(cfg)  # colocated: every stage on these ranks
        online = self.preset.online
        self.training = TrainingHost(cfg, self.model_path, self.spans, self.pool, self.ranks,
                                     generates=online)
        self.assessment = AssessmentHost(cfg, self.model_path, self.spans, self.ranks, group,
                                         self.training)
        self.generation = (GenerationHost(cfg, self.model_path, self.spans, self.pool,
                                          self.ranks, self.training) if online else None)
        # offline algorithms read preference pairs instead of generating
        self.pairs = None if online else PromptStream(read_preference_file(d.preference_file),
                                                      cfg.seed)
        a = cfg.algo
        self.kl = kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)
        self.step = 0
        self.eval_history: list[tuple[int, float]] = []
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.tracer = Tracer(run_dir / "trace.json")

    def _default_model(self) -> Path:
        """The built-in model, built (and cached) by one process while the others wait."""
        if world_size() == 1:
            return ensure_default_model(self.cfg, self.device)
        if torch.distributed.get_rank() == 0:
            ensure_default_model(self.cfg, self.device)
        torch.distributed.barrier()
        return ensure_default_model(self.cfg, self.device)

    @property
    def main(self) -> bool:
        """The process that writes files and prints (rank 0, or the only one)."""
        return self.ranks.main

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The loop state; with one rank also the whole weights and optimizer state (a group
        of ranks writes DCP shards beside it: `checkpoint`)."""
        data = (self.generation.state() if self.generation is not None
                else {"data_position": self.pairs.position})
        return {"step": self.step, "kl_coef": self.kl.value, **self.training.state(), **data,
                "eval_history": self.eval_history}

    def resume(self) -> bool:
        """Continue from the newest checkpoint; forget metrics and spans logged after it."""
        state = load_latest(self.run_dir)
        if state is None:
            return False
        latest = checkpoint_dirs(self.run_dir)[-1]
        sharded = (latest / "actor").is_dir()  # DCP shards load at any layout
        if not sharded and self.ranks.world > 1:
            raise ConfigError(f"{latest} holds whole weights (written by one process); this "
                              f"run has {self.ranks.world} ranks: resume it in one process, "
                              "then change layouts at the next checkpoint")
        self.step = state["step"]
        self.kl.value = state["kl_coef"]
        self.eval_history = [tuple(e) for e in state["eval_history"]]
        self.training.load_state(state)
        if sharded:
            self.training.load_shards(latest)
        if self.generation is not None:
            self.generation.load_state(state)
        else:
            self.pairs.position = state["data_position"]
        if self.main:  # one writer: two ranks racing on the same rename lose the log
            self.metrics.truncate_after(self.step)
        self.tracer.drop_after(self.step)
        return True

    # -- loop ------------------------------------------------------------------------------
    def evaluate(self) -> float:
        acc = self.training.evaluate(self.step)
        self.eval_history.append((self.step, acc))
        return acc

    def online_step(self, step: int) -> dict[str, Any]:
        batch, ginfo = self.generation.generate(step)
        exp, ainfo = self.assessment.assess(step, batch, self.kl.value)
        stats = self.training.train(step, exp, self.kl.value, correct=False)
        row, kl_now = step_row({**ginfo, "dropped": 0}, ainfo, stats, self.kl.value)
        self.kl.update(kl_now, len(row["response_lens"]))
        return row

    def offline_step(self, step: int) -> dict[str, float]:
        pairs = self.pairs.next(self.cfg.train.prompts_per_step)
        t = self.training
        with self.spans.span("training", step, "actor+reference") as span, \
                compute_precision(self.cfg.train.compute_dtype, self.device):
            stats = preference_step(t.policy, self.assessment.reference, t.optimizer,
                                    t.tokenizer, pairs, self.cfg.algo, self.cfg.train.grad_clip)
        t.version = step
        return {**stats, "gen_s": 0.0, "assess_s": 0.0, "train_s": span["seconds"]}

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        step = self.step + 1
        row = self.online_step(step) if self.preset.online else self.offline_step(step)
        self.step = step
        return {"step": step, **row, "step_s": time.perf_counter() - t0}

    def checkpoint(self) -> None:
        """checkpoints/step_NNNNNN, atomically; a group's ranks each write their DCP shards of
        the trained models into it first."""
        state, ranks = self.state_dict(), self.ranks
        if ranks.world == 1:
            save_state(self.run_dir, self.step, state, self.cfg.checkpoint.keep)
        else:
            def shards(tmp: Path) -> None:  # rank 0 names the directory, every rank writes
                self.training.save_shards(Path(ranks.gather(str(tmp))[0]))
            if ranks.main:
                save_state(self.run_dir, self.step, state, self.cfg.checkpoint.keep,
                           write=shards)
            else:
                shards(Path())
            ranks.barrier()
        if self.main:
            self._save_trace()

    def _save_trace(self) -> None:
        self.tracer.events += self.spans.drain()
        self.tracer.save()

    def export(self, path: Path) -> None:
        """The policy as a Hugging Face checkpoint (gathered from its shards in a group)."""
        weights = self.ranks.full_state(self.training.policy)
        if self.main:
            save_final(self.cfg, self.model_path, weights, path)
        self.ranks.barrier()

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the first and last held-out accuracy."""
        cfg = self.cfg
        if self.step == 0 and not self.eval_history:
            before = self.evaluate()
            if self.main:
                print(f"held-out greedy accuracy before RL: {before:.3f}")
        with progress_bar("rl", cfg.train.steps, done=self.step, show=self.main) as bar:
            while self.step < cfg.train.steps:
                row = self.train_step()
                if self.step % cfg.eval.every == 0 or self.step == cfg.train.steps:
                    row["eval_accuracy"] = self.evaluate()
                if self.main:
                    self.metrics.append(row)
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps:
                    self.checkpoint()
                bar.advance(**{k: row.get(k) for k in PROGRESS_KEYS})
        self.export(self.run_dir / "final")
        before, after = self.eval_history[0][1], self.eval_history[-1][1]
        if self.main:
            self._save_trace()
            plot_run(self.metrics.rows(), self.eval_history, self.run_dir / "summary.png")
            print(f"held-out greedy accuracy: before RL {before:.3f}, after RL {after:.3f} "
                  f"({100 * (after - before):+.1f} points) over "
                  f"{len(self.training.eval_set)} problems")
        return {"eval_before": before, "eval_after": after}


def train(cfg: RunConfig, resume_dir: Path | None = None) -> dict[str, float]:
    try:
        run_dir = resume_dir or new_run_dir(cfg)
        trainer = Trainer(cfg, run_dir)  # validates everything before the run directory exists
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume_dir is not None and trainer.resume() and trainer.main:
            print(f"resuming {run_dir} at step {trainer.step}")
        if trainer.main:
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        try:
            return trainer.run()
        finally:
            if trainer.pool is not None:
                trainer.pool.close()
    finally:
        leave_world()
