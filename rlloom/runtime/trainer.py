"""The single-process RL loop: steps of Generation -> Assessment -> Training, with held-out
evaluation, metrics, a trace, checkpoints and resume."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from rlloom.config import ConfigError, RunConfig, dump_config
from rlloom.data.prompts import DataError, PromptStream, load_prompt_sets
from rlloom.data.synthetic import Problem
from rlloom.models.hf_io import load_model, load_tokenizer, save_checkpoint
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.checkpoint import load_latest
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.evaluate import greedy_accuracy
from rlloom.runtime.grpo import assess, encode, optimise, sample_group
from rlloom.runtime.metrics import MetricsLog
from rlloom.runtime.plots import plot_run
from rlloom.runtime.progress import progress_bar
from rlloom.runtime.tracing import Tracer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_runnable(cfg: RunConfig) -> None:
    """Refuse, before any work, what this runtime cannot execute."""
    problems = cfg.plan.single_process_problems()
    if problems:
        raise ConfigError("the single-process runtime cannot run this plan: " +
                          "; ".join(problems))
    for key, registry, name in [("algo.advantage", ADVANTAGES, cfg.algo.advantage),
                                ("algo.policy_loss", POLICY_LOSSES, cfg.algo.policy_loss),
                                ("algo.loss_agg", AGGREGATIONS, cfg.algo.loss_agg),
                                ("algo.kl_estimator", KL_ESTIMATORS, cfg.algo.kl_estimator)]:
        if name not in registry.names():
            raise ConfigError(f"{key}={name!r} is not registered; choose one of "
                              f"{', '.join(registry.names())}")


def check_prompt_lengths(tokenizer: PreTrainedTokenizerBase, problems: list[Problem], limit: int,
                         source: str) -> None:
    lengths = [len(ids) for ids in encode(tokenizer, [p.prompt for p in problems])]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if too_long:
        i, n = too_long[0]
        raise DataError(f"{source}: {len(too_long)} prompts exceed data.max_prompt_tokens="
                        f"{limit} (prompt #{i} has {n} tokens: {problems[i].prompt[:40]!r}...); "
                        "raise data.max_prompt_tokens or shorten the prompts")


def new_run_dir(cfg: RunConfig) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        check_runnable(cfg)
        self.cfg, self.run_dir = cfg, run_dir
        torch.set_num_threads(cfg.train.threads or os.cpu_count() or 1)
        model_path = Path(cfg.model.path) if cfg.model.path else ensure_default_model(cfg)
        dtype = DTYPES[cfg.model.dtype]
        self.tokenizer = load_tokenizer(model_path)
        if self.tokenizer.eos_token_id is None or self.tokenizer.pad_token_id is None:
            raise DataError(f"the tokenizer in {model_path} needs an EOS and a pad token")
        self.policy = load_model(model_path, dtype)
        self.reference = load_model(model_path, dtype).eval().requires_grad_(False)
        d = cfg.data
        sets = load_prompt_sets(d.task, d.difficulty, cfg.seed, d.train_size, d.eval_size,
                                d.prompt_file, d.eval_fraction)
        source = d.prompt_file or f"built-in task {d.task}"
        check_prompt_lengths(self.tokenizer, sets.train + sets.eval, d.max_prompt_tokens, source)
        self.eval_set = sets.eval
        self.stream = PromptStream(sets.train, cfg.seed)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.sample_gen = torch.Generator().manual_seed(cfg.seed)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.step = 0
        self.eval_history: list[tuple[int, float]] = []
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.tracer = Tracer(run_dir / "trace.json")

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "policy": self.policy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "sample_gen": self.sample_gen.get_state(),
                "shuffle_gen": self.shuffle_gen.get_state(),
                "data_position": self.stream.position, "eval_history": self.eval_history}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sample_gen.set_state(state["sample_gen"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        self.stream.position = state["data_position"]
        self.eval_history = state["eval_history"]

    def resume(self) -> bool:
        """Continue from the newest checkpoint; forget metrics and spans logged after it."""
        state = load_latest(self.run_dir)
        if state is None:
            return False
        self.load_state_dict(state)
        self.metrics.truncate_after(self.step)
        self.tracer.drop_after(self.step)
        return True

    # -- loop ------------------------------------------------------------------------------
    def evaluate(self) -> float:
        with self.tracer.span("eval", self.step, "eval"):
            acc = greedy_accuracy(self.policy, self.tokenizer, self.eval_set, self.cfg.data.task,
                                  self.cfg.eval.max_new_tokens)
        self.eval_history.append((self.step, acc))
        return acc

    def train_step(self) -> dict[str, float]:
        cfg, step = self.cfg, self.step + 1
        r = cfg.rollout
        params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
        t0 = time.perf_counter()
        problems = self.stream.next(cfg.train.prompts_per_step)
        with self.tracer.span("generation", step, "actor") as gen:
            rollout, groups = sample_group(self.policy, self.tokenizer, problems, r.n_samples,
                                           params, self.sample_gen)
        with self.tracer.span("assessment", step, "reference+reward") as ass:
            exp = assess(self.reference, self.tokenizer, problems, rollout, groups,
                         cfg.data.task, cfg.algo, r.temperature)
        with self.tracer.span("training", step, "actor") as tr:
            stats = optimise(self.policy, self.optimizer, exp, cfg.algo, r.temperature,
                             cfg.train.grad_clip, self.shuffle_gen)
        self.step = step
        return {"step": step, "reward": exp.rewards.mean().item(),
                "accuracy": exp.correct.float().mean().item(),
                "response_len": rollout.response_lengths.float().mean().item(),
                "truncated": (~rollout.finished).float().mean().item(), **stats,
                "gen_s": gen.seconds, "assess_s": ass.seconds, "train_s": tr.seconds,
                "step_s": time.perf_counter() - t0}

    def checkpoint(self) -> None:
        save_state(self.run_dir, self.step, self.state_dict(), self.cfg.checkpoint.keep)
        self.tracer.save()

    def run(self) -> dict[str, float]:
        """Train to `train.steps`; returns the first and last held-out accuracy."""
        cfg = self.cfg
        if self.step == 0 and not self.eval_history:
            print(f"held-out greedy accuracy before RL: {self.evaluate():.3f}")
        with progress_bar("rl", cfg.train.steps, done=self.step) as bar:
            while self.step < cfg.train.steps:
                row = self.train_step()
                if self.step % cfg.eval.every == 0 or self.step == cfg.train.steps:
                    row["eval_accuracy"] = self.evaluate()
                self.metrics.append(row)
                if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps:
                    self.checkpoint()
                bar.advance(reward=row["reward"], acc=row["accuracy"], kl=row["kl"],
                            eval=row.get("eval_accuracy"), step_s=row["step_s"])
        save_checkpoint(self.policy, self.tokenizer, self.run_dir / "final")
        self.tracer.save()
        plot_run(self.metrics.rows(), self.run_dir / "summary.png")
        before, after = self.eval_history[0][1], self.eval_history[-1][1]
        print(f"held-out greedy accuracy: before RL {before:.3f}, after RL {after:.3f} "
              f"({100 * (after - before):+.1f} points) over {len(self.eval_set)} problems")
        return {"eval_before": before, "eval_after": after}


def train(cfg: RunConfig, resume_dir: Path | None = None) -> dict[str, float]:
    run_dir = resume_dir or new_run_dir(cfg)
    trainer = Trainer(cfg, run_dir)  # validates everything before the run directory exists
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_dir is not None and trainer.resume():
        print(f"resuming {run_dir} at step {trainer.step}")
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return trainer.run()
