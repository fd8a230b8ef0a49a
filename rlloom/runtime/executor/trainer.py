"""The single-process RL loop: steps of Generation -> Assessment -> Training, with held-out
evaluation, metrics, a trace, checkpoints and resume."""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.contracts import algo_problems
from rlloom.algos.kl import kl_controller
from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig, dump_config
from rlloom.data.preferences import read_preference_file
from rlloom.data.prompts import DataError, PromptStream, load_prompt_sets
from rlloom.data.synthetic import Problem
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.hf_io import (
    DTYPES,
    load_model,
    load_tokenizer,
    save_checkpoint,
)
from rlloom.models.transformer import CausalLM
from rlloom.parallel.apply import full_state_dict
from rlloom.parallel.mesh import layout_problems, layout_summary
from rlloom.plan import Layout
from rlloom.rewards.sandbox import SandboxPool
from rlloom.runtime.checkpoint import load_latest, load_whole_state, whole_state
from rlloom.runtime.checkpoint import save_checkpoint as save_state
from rlloom.runtime.default_model import ensure_default_model
from rlloom.runtime.device import resolve_device
from rlloom.runtime.executor.distributed import (
    TorchrunLayouts,
    distributed_problems,
    join_torchrun,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    world_size,
)
from rlloom.runtime.executor.ranks import RankGroup, leave_world, reshard
from rlloom.runtime.outputs.metrics import MetricsLog
from rlloom.runtime.outputs.plots import plot_run
from rlloom.runtime.outputs.progress import progress_bar
from rlloom.runtime.outputs.tracing import Tracer
from rlloom.runtime.stages.batch import encode
from rlloom.runtime.stages.evaluate import greedy_accuracy
from rlloom.runtime.stages.offline import preference_step
from rlloom.runtime.stages.online import (
    Rewarder,
    Samples,
    assess,
    behaviour_kl,
    generate_group,
    greedy_baseline,
    optimise,
)

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


def check_prompt_lengths(tokenizer: PreTrainedTokenizerBase, problems: list[Problem], limit: int,
                         source: str) -> None:
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
    def __init__(self, cfg: RunConfig, run_dir: Path) -> None:
        world = world_size()
        check_runnable(cfg, world)
        self.cfg, self.run_dir = cfg, run_dir
        self.preset = PRESETS[cfg.algo.name]
        # every model lives here, and every tensor that meets their outputs
        self.ranks = (join_torchrun(cfg.train.device) if world > 1
                      else RankGroup(device=resolve_device(cfg.train.device)))
        self.device = self.ranks.device
        self.layouts = TorchrunLayouts.of(cfg) if world > 1 else None
        # processes on one machine share its cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local))
        model_path = Path(cfg.model.path) if cfg.model.path else self._default_model()
        dtype = DTYPES[cfg.model.dtype]
        self.policy = load_model(model_path, dtype).to(self.device)
        self.tokenizer = load_tokenizer(model_path)
        if self.tokenizer.eos_token_id is None or self.tokenizer.pad_token_id is None:
            raise DataError(f"the tokenizer in {model_path} needs an EOS and a pad token")
        a = cfg.algo
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if "critic" in self.preset.roles:
            if cfg.plan.actor_critic == "shared":
                self.policy = ActorCritic.from_policy(self.policy).to(self.device)
            else:
                self.critic = ValueModel.from_policy(self.policy).to(self.device)
                self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(),
                                                          lr=a.critic_lr)
        self.reference = (load_model(model_path, dtype).to(self.device).eval()
                          .requires_grad_(False) if cfg.needs_reference else None)
        self.pool = (SandboxPool(cfg.reward.sandbox_workers) if cfg.data.task == "code"
                     else None)
        self.rewarder = Rewarder.build(cfg, self.tokenizer, self.pool, self.device)
        self.kl = kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)
        d = cfg.data
        sets = load_prompt_sets(d.task, d.difficulty, cfg.seed, d.train_size, d.eval_size,
                                d.prompt_file, d.eval_fraction, d.columns)
        source = d.prompt_file or f"built-in task {d.task}"
        check_prompt_lengths(self.tokenizer, sets.train + sets.eval, d.max_prompt_tokens, source)
        self.eval_set = sets.eval
        train_items = sets.train if self.preset.online else read_preference_file(
            d.preference_file)
        self.stream = PromptStream(train_items, cfg.seed)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        # generation replicas sample their own streams; replica 0's is the one process's
        replica = self.ranks.share(self.layouts.gen).part if self.layouts else 0
        self.sample_gen = torch.Generator().manual_seed(cfg.seed + replica)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.step = 0
        self.eval_history: list[tuple[int, float]] = []
        self.metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.tracer = Tracer(run_dir / "trace.json")
        self.generator = self.policy  # the model that generates (a copy in a hybrid layout)
        if world > 1:
            self._parallelize()

    def _parallelize(self) -> None:
        """Apply the plan's layouts (torchrun): the actor and critic train in the actor's
        layout, the reference scores in its dp x tp (no gradients, so no DP wrapper), and
        generation may run on a copy (see `TorchrunLayouts`)."""
        lay, ranks, cfg = self.layouts, self.ranks, self.cfg
        for layout in (lay.train, lay.gen):
            problems = layout_problems(layout, self.policy.config, ranks.world)
            if problems:
                raise ConfigError(f"plan layout {layout_summary(layout)} cannot run: "
                                  + "; ".join(problems))
        if lay.gen_copy:
            self.generator = ranks.generating(copy.deepcopy(self.policy), lay.gen)
        _, self.optimizer = ranks.trained(self.policy, lay.train, cfg.train.lr,
                                       weight_decay=cfg.train.weight_decay)
        if self.critic is not None:
            _, self.critic_optimizer = ranks.trained(self.critic, lay.train, cfg.algo.critic_lr)
        if self.reference is not None:
            ranks.frozen(self.reference, self.frozen_layout)

    @property
    def frozen_layout(self) -> Layout:
        """The reference's layout: the actor's dp x tp, without sharding over dp."""
        train = self.layouts.train if self.layouts else Layout()
        return Layout(dp=train.dp, tp=train.tp)

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

    def _trained_parts(self) -> dict:
        parts = {"actor": (self.policy, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_optimizer)
        return parts

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"step": self.step, "kl_coef": self.kl.value,
                 **self.ranks.sampling_state(self.sample_gen),
                 "shuffle_gen": self.shuffle_gen.get_state(),
                 "data_position": self.stream.position, "eval_history": self.eval_history}
        if self.layouts is None:  # sharded runs save model and optimizer state with DCP
            state.update(whole_state(self._trained_parts()))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        if "policy" in state:
            load_whole_state(self._trained_parts(), state)
        self.kl.value = state["kl_coef"]
        self.ranks.load_sampling_state(self.sample_gen, state)
        self.shuffle_gen.set_state(state["shuffle_gen"])
        self.stream.position = state["data_position"]
        self.eval_history = state["eval_history"]

    def resume(self) -> bool:
        """Continue from the newest checkpoint; forget metrics and spans logged after it."""
        state = (load_latest(self.run_dir) if self.layouts is None else
                 load_sharded_checkpoint(self.run_dir, self._trained_parts()))
        if state is None:
            return False
        self.load_state_dict(state)
        if self.main:  # one writer: two ranks racing on the same rename lose the log
            self.metrics.truncate_after(self.step)
        self.tracer.drop_after(self.step)
        return True

    # -- loop ------------------------------------------------------------------------------
    def evaluate(self) -> float:
        with self.tracer.span("eval", self.step, "eval"):
            acc = greedy_accuracy(self.policy, self.tokenizer, self.eval_set, self.cfg,
                                  self.pool)
        self.eval_history.append((self.step, acc))
        return acc

    def _generate(self) -> tuple[Samples, dict[str, float]]:
        """The step's whole batch of scored samples (on every rank), and what moving the
        weights into the generation layout cost."""
        cfg, lay = self.cfg, self.layouts
        sync = {}
        if lay is not None and lay.gen_copy:
            seconds, nbytes = reshard(self.policy, self.generator)
            sync = {"reshard_s": seconds, "reshard_bytes": nbytes}
        return generate_group(self.generator, self.tokenizer, self.stream, cfg, self.rewarder,
                              self.sample_gen, self.ranks,
                              self.ranks.share(lay.gen if lay else Layout())), sync

    def online_step(self, step: int) -> dict[str, float]:
        cfg, ranks = self.cfg, self.ranks
        train = self.layouts.train if self.layouts else Layout()
        with self.tracer.span("generation", step, "actor") as gen:
            samples, sync = self._generate()
            baseline = (greedy_baseline(self.policy, self.tokenizer, samples, cfg, self.rewarder)
                        if cfg.algo.advantage == "remax" else None)
        with self.tracer.span("assessment", step, "reference+reward+critic") as ass:
            critic = self.critic or (self.policy if isinstance(self.policy, ActorCritic)
                                     else None)
            exp = assess(samples, self.reference, critic, self.kl.value, baseline, cfg, ranks,
                         ranks.share(self.frozen_layout), ranks.share(train))
        with self.tracer.span("training", step, "actor+critic") as tr:
            # in a group every rank runs as many micro-batches as the others (in assessment
            # too), so the ranks' collectives (gradient sync, ZeRO-3 gathers) pair up
            stats = optimise(self.policy, self.optimizer, exp, self.critic,
                             self.critic_optimizer, self.kl.value, cfg, self.shuffle_gen,
                             ranks.share(train), ranks.share(train), ranks.agree())
        stats = ranks.mean({**stats, "behaviour_kl": behaviour_kl(exp)})
        kl_now = stats.pop("behaviour_kl")
        row = {**samples.stats(), "kl": stats.pop("kl", kl_now), "kl_coef": self.kl.value,
               **stats,
               # rewards are computed as samples finish (dynamic sampling needs them): they are
               # Assessment work even though they run inside the generation span
               "gen_s": gen.seconds - samples.score_s,
               "assess_s": ass.seconds + samples.score_s, "train_s": tr.seconds, **sync}
        self.kl.update(kl_now, len(samples.scores))
        return row

    def offline_step(self, step: int) -> dict[str, float]:
        pairs = self.stream.next(self.cfg.train.prompts_per_step)
        with self.tracer.span("training", step, "actor+reference") as tr:
            stats = preference_step(self.policy, self.reference, self.optimizer, self.tokenizer,
                                    pairs, self.cfg.algo, self.cfg.train.grad_clip)
        return {**stats, "gen_s": 0.0, "assess_s": 0.0, "train_s": tr.seconds}

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        step = self.step + 1
        row = self.online_step(step) if self.preset.online else self.offline_step(step)
        self.step = step
        return {"step": step, **row, "step_s": time.perf_counter() - t0}

    def checkpoint(self) -> None:
        if self.layouts is None:
            save_state(self.run_dir, self.step, self.state_dict(), self.cfg.checkpoint.keep)
        else:
            save_sharded_checkpoint(self.ranks, self.run_dir, self.step, self.state_dict(),
                                    self._trained_parts(), self.cfg.checkpoint.keep)
        if self.main:
            self.tracer.save()

    def export(self, path: Path) -> None:
        """The policy as a Hugging Face checkpoint (gathered from its shards under torchrun)."""
        if self.layouts is None:
            save_checkpoint(self.policy, self.tokenizer, path)
            return
        state = full_state_dict(self.policy)
        if self.main:
            plain = CausalLM(self.policy.config)
            plain.load_state_dict(state)
            save_checkpoint(plain, self.tokenizer, path)
        torch.distributed.barrier()

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
            self.tracer.save()
            plot_run(self.metrics.rows(), self.eval_history, self.run_dir / "summary.png")
            print(f"held-out greedy accuracy: before RL {before:.3f}, after RL {after:.3f} "
                  f"({100 * (after - before):+.1f} points) over {len(self.eval_set)} problems")
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
