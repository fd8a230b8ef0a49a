"""The roles of the multi-model runtime, and the process (a Ray actor) that hosts some of them.

A `GroupWorker` is one process of a device group. It hosts any subset of three roles:

- generation: the actor's sampling copy, the prompt stream, the sampling RNG and the rewarder
  (rule verifier, sandbox pool, reward model: rewards are scored as samples finish, as in the
  single-process runtime, because dynamic sampling needs them);
- assessment: the frozen reference and, for PPO, a copy of the critic for its forward pass;
- training: the policy, the critic, their optimizers and the shuffling RNG; held-out
  evaluation runs here because the newest weights live here.

Each role builds its models with the single-process trainer's loaders and seeds and runs the
stage functions of `online.py` (`collect`, `assess`, `optimise`), so a synchronous run
matches `rlloom train` without Ray. Roles in one process share one model object instead of
a synced copy (generation of a colocated or interleaved group reads the trainer's live
weights: the process runs one request at a time, so they cannot change mid-request).

This module imports no Ray: the driver (`ray_runtime.py`) wraps `GroupWorker` as an actor and
picks each call's concurrency group ("control" for pings, spans and weight pushes, which must
answer while a stage runs on the default thread).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from rlloom.algos.kl import LOG_RATIO_CLAMP
from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.data.prompts import PromptStream, load_prompt_sets
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.hf_io import CheckpointError, load_model, load_tokenizer, load_value_model
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rollout.generate import cat_rollouts
from rlloom.runtime.batch import response_logprobs, response_values
from rlloom.runtime.evaluate import greedy_accuracy
from rlloom.runtime.online import (
    Experience,
    Rewarder,
    Samples,
    assess,
    assess_from,
    behaviour_kl,
    collect,
    greedy_baseline,
    optimise,
    sample_groups,
)
from rlloom.runtime.ray_plan import STAGE_ROLES
from rlloom.runtime.trainer import DTYPES
from rlloom.runtime.weight_sync import ShadowModel, SyncStats

# losses whose stale samples the trainer corrects as decoupled PPO (see `decoupled`)
DECOUPLED_LOSSES = ("ppo", "decoupled_ppo")


# -- batches and stage helpers (no Ray, unit-tested directly) -------------------------------

@dataclass
class Batch:
    """What generation hands to assessment: scored groups, the ReMax baseline, and the weight
    version that sampled them."""
    samples: Samples
    baseline: torch.Tensor | None  # [n] ReMax greedy reward, else None
    version: int


def merge_samples(parts: list[Samples], pad_id: int) -> Samples:
    """Chunks of whole groups as one batch (group ids renumbered, responses re-padded)."""
    offsets, groups = [], 0
    for s in parts:
        offsets.append(groups)
        groups += len(s.problems)
    return Samples([p for s in parts for p in s.problems],
                   cat_rollouts([s.rollout for s in parts], pad_id),
                   torch.cat([s.group_ids + o for s, o in zip(parts, offsets)]),
                   {k: torch.cat([s.terms[k] for s in parts]) for k in parts[0].terms},
                   torch.cat([s.scores for s in parts]), max(s.rounds for s in parts),
                   sum(s.score_s for s in parts))


def pad_right(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if x is None:
        return None
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


@torch.no_grad()
def model_outputs(s: Samples, reference: torch.nn.Module | None,
                  critic: torch.nn.Module | None, cfg: RunConfig
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The forward passes of assessment: reference log-probs and critic values [n, T]."""
    r = s.rollout
    ref_logp = (response_logprobs(reference, r, cfg.rollout.temperature)[0]
                if reference is not None else None)
    return ref_logp, response_values(critic, r) if critic is not None else None


@torch.no_grad()
def decoupled(exp: Experience, policy: torch.nn.Module, temperature: float, minibatches: int
              ) -> tuple[Experience, float]:
    """Decoupled PPO for stale samples, expressed for the plain `ppo` loss that `optimise`
    calls: the proximal log-probs (the weights before this update) replace the behaviour
    log-probs as PPO's `old_logp`, and the advantages are scaled by the detached behaviour
    weight w = exp(prox - behaviour). Because w > 0 is constant per token, min(r wA, clip(r) wA)
    = w min(rA, clip(r) A) with the same clipped branch (and dual clip), so the loss equals
    `decoupled_ppo(logp, behaviour, A, prox)` (tests/runtime/test_ray_stages.py).
    Returns the corrected experience and the k1 KL(behaviour || proximal) per token."""
    r = exp.samples.rollout
    n = len(r.finished)
    prox = torch.cat([response_logprobs(policy, r.select(idx), temperature)[0]
                      for idx in torch.arange(n).chunk(minibatches)])
    mask = r.response_mask.float()
    keep = mask > 0
    prox, old = torch.where(keep, prox, 0.0), torch.where(keep, r.logprobs, 0.0)
    weight = (prox - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    kl = (((old - prox) * mask).sum() / mask.sum().clamp(min=1)).item()
    samples = replace(exp.samples, rollout=replace(r, logprobs=prox))
    return replace(exp, samples=samples, advantages=exp.advantages * weight), kl


def sample_stats(s: Samples) -> dict[str, Any]:
    """The single-process trainer's per-step sample metrics."""
    r = s.rollout
    return {"reward": s.scores.mean().item(),
            **{f"reward/{k}": v.float().mean().item() for k, v in s.terms.items()},
            "accuracy": s.correct.float().mean().item(),
            "response_len": r.response_lengths.float().mean().item(),
            "truncated": (~r.finished).float().mean().item(),
            "sample_rounds": s.rounds,
            "prompt_len": r.prompt_mask.sum(1).float().mean().item(),
            "response_lens": r.response_lengths.tolist()}


# -- tracing --------------------------------------------------------------------------------

class SpanLog:
    """Chrome-trace events of one worker: pid is its group, tid the role's lane. Timestamps are
    wall-clock (time.time()), comparable across processes of one machine."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._events: list[dict] = []
        self._lock = threading.Lock()

    @contextmanager
    def span(self, name: str, step: int, lane: str, **args: Any) -> Iterator[dict]:
        start, t0 = time.time(), time.perf_counter()
        info: dict[str, Any] = {}
        try:
            yield info
        finally:
            info["seconds"] = time.perf_counter() - t0
            with self._lock:
                self._events.append({"name": name, "ph": "X", "pid": self.group, "tid": lane,
                                     "ts": start * 1e6, "dur": info["seconds"] * 1e6,
                                     "args": {"step": step, **args}})

    def drain(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events


# -- roles ----------------------------------------------------------------------------------

class LiveModel:
    """The trainer's own weights, read in place (generation in the trainer's process)."""

    def __init__(self, training: "TrainingRole", critic: bool = False) -> None:
        self.training, self.critic = training, critic

    @contextmanager
    def read(self) -> Iterator[tuple[int, torch.nn.Module]]:
        t = self.training
        model = t.critic if self.critic and t.critic is not None else t.policy
        yield t.version, model


def _policy(cfg: RunConfig, model_path: Path) -> torch.nn.Module:
    """The policy as the trainer builds it (an ActorCritic when the critic shares it)."""
    policy = load_model(model_path, DTYPES[cfg.model.dtype])
    if "critic" in PRESETS[cfg.algo.name].roles and cfg.plan.actor_critic == "shared":
        policy = ActorCritic.from_policy(policy)
    return policy


class TrainingRole:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog,
                 pool: SandboxPool | None) -> None:
        self.cfg, self.spans, self.pool = cfg, spans, pool
        a = cfg.algo
        self.policy = _policy(cfg, model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if "critic" in PRESETS[a.name].roles and cfg.plan.actor_critic != "shared":
            self.critic = ValueModel.from_policy(self.policy)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=a.critic_lr)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        d = cfg.data
        self.eval_set = load_prompt_sets(d.task, d.difficulty, cfg.seed, d.train_size,
                                         d.eval_size, d.prompt_file, d.eval_fraction,
                                         d.columns).eval
        self.version = 0  # optimizer steps taken: the weight version
        # `optimise` calls the plain loss; decoupled_ppo is run through it (see `decoupled`)
        self.opt_cfg = (cfg.model_copy(update={"algo": a.model_copy(
            update={"policy_loss": "ppo"})}) if a.policy_loss == "decoupled_ppo" else cfg)

    def train(self, step: int, exp: Experience, kl_coef: float, correct: bool
              ) -> dict[str, Any]:
        lane = "actor+critic" if self.critic is not None else "actor"
        extra: dict[str, float] = {}
        with self.spans.span("training", step, lane) as span:
            if correct:
                exp, extra["behaviour_kl"] = decoupled(exp, self.policy,
                                                       self.cfg.rollout.temperature,
                                                       self.cfg.algo.minibatches)
            stats = optimise(self.policy, self.optimizer, exp, self.critic,
                             self.critic_optimizer, kl_coef, self.opt_cfg, self.shuffle_gen)
        self.version = step
        return {**stats, **extra, "train_s": span["seconds"], "version": step}

    def evaluate(self, step: int) -> float:
        with self.spans.span("eval", step, "eval"):
            return greedy_accuracy(self.policy, self.tokenizer, self.eval_set, self.cfg,
                                   self.pool)

    def state(self) -> dict[str, Any]:
        state = {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "shuffle_gen": self.shuffle_gen.get_state()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic_optimizer.state_dict()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.version = state["step"]
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_optimizer.load_state_dict(state["critic_optimizer"])


class GenerationRole:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog,
                 pool: SandboxPool | None, training: TrainingRole | None) -> None:
        self.cfg, self.spans = cfg, spans
        self.tokenizer = load_tokenizer(model_path)
        self.weights: LiveModel | ShadowModel = (
            LiveModel(training) if training is not None else ShadowModel(_policy(cfg, model_path)))
        reward_model = (load_value_model(cfg.reward.model_path, DTYPES[cfg.model.dtype]).eval()
                        .requires_grad_(False) if cfg.reward.model_path else None)
        if reward_model is not None and reward_model.config.vocab_size != len(self.tokenizer):
            raise CheckpointError(f"reward model {cfg.reward.model_path} has a vocabulary of "
                                  f"{reward_model.config.vocab_size}, the policy's tokenizer "
                                  f"{len(self.tokenizer)}; they must share the tokenizer")
        self.rewarder = Rewarder(cfg, self.tokenizer, reward_model, pool)
        d = cfg.data
        sets = load_prompt_sets(d.task, d.difficulty, cfg.seed, d.train_size, d.eval_size,
                                d.prompt_file, d.eval_fraction, d.columns)
        self.stream = PromptStream(sets.train, cfg.seed)
        self.sample_gen = torch.Generator().manual_seed(cfg.seed)

    def generate(self, step: int, prompts: int | None = None) -> tuple[Batch, dict[str, Any]]:
        """A step's B prompts x K samples (`collect`, with dynamic sampling), or, for a fused
        schedule, the next chunk of `prompts` prompts; the weights are read once, at the
        start, so a request never mixes versions."""
        cfg = self.cfg
        with self.weights.read() as (version, policy):
            with self.spans.span("generation", step, "actor", version=version) as span:
                if prompts is None:
                    samples = collect(policy, self.tokenizer, self.stream, cfg, self.rewarder,
                                      self.sample_gen)
                else:
                    samples = sample_groups(policy, self.tokenizer, self.stream.next(prompts),
                                            cfg, self.rewarder, self.sample_gen)
                baseline = (greedy_baseline(policy, self.tokenizer, samples, cfg, self.rewarder)
                            if cfg.algo.advantage == "remax" else None)
        return Batch(samples, baseline, version), {
            "version": version, "gen_s": span["seconds"] - samples.score_s,
            "score_s": samples.score_s, "rollouts": len(samples.scores)}

    def state(self) -> dict[str, Any]:
        return {"sample_gen": self.sample_gen.get_state(), "data_position": self.stream.position}

    def load_state(self, state: dict[str, Any]) -> None:
        self.sample_gen.set_state(state["sample_gen"])
        self.stream.position = state["data_position"]


class AssessmentRole:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog,
                 training: TrainingRole | None) -> None:
        self.cfg, self.spans = cfg, spans
        a = cfg.algo
        dtype = DTYPES[cfg.model.dtype]
        self.reference = (load_model(model_path, dtype).eval().requires_grad_(False)
                          if cfg.needs_reference else None)
        self.critic: LiveModel | ShadowModel | None = None
        if "critic" in PRESETS[a.name].roles:
            if training is not None:
                self.critic = LiveModel(training, critic=True)
            else:  # a copy of the trainer's critic, refreshed by weight sync after each step
                policy = _policy(cfg, model_path)
                self.critic = ShadowModel(policy if isinstance(policy, ActorCritic)
                                          else ValueModel.from_policy(policy))
        self.pad_id = load_tokenizer(model_path).pad_token_id
        # step -> chunk -> (batch, ref_logp, values) of a fused schedule's assessed chunks
        self._chunks: dict[int, dict[int, tuple[Batch, torch.Tensor | None,
                                                torch.Tensor | None]]] = {}
        self._chunk_s: dict[int, float] = {}  # step -> seconds its chunks took

    @contextmanager
    def _critic(self) -> Iterator[torch.nn.Module | None]:
        if self.critic is None:
            yield None
            return
        with self.critic.read() as (_, critic):
            yield critic

    def _lane(self) -> str:
        return "reference+critic" if self.critic is not None else "reference"

    def _info(self, exp: Experience, seconds: float) -> dict[str, Any]:
        return {"assess_s": seconds, "behaviour_kl_ref": behaviour_kl(exp),
                "samples": sample_stats(exp.samples)}

    def assess(self, step: int, batch: Batch, kl_coef: float) -> tuple[Experience, dict]:
        with self.spans.span("assessment", step, self._lane()) as span, \
                self._critic() as critic:
            exp = assess(batch.samples, self.reference, critic, kl_coef, batch.baseline,
                         self.cfg)
        return exp, self._info(exp, span["seconds"])

    def assess_chunk(self, step: int, chunk: int, batch: Batch) -> int:
        """Fused schedule: the forward passes of one chunk, as soon as it is generated."""
        with self.spans.span("assessment", step, self._lane(), chunk=chunk) as span, \
                self._critic() as critic:
            ref_logp, values = model_outputs(batch.samples, self.reference, critic, self.cfg)
        self._chunks.setdefault(step, {})[chunk] = (batch, ref_logp, values)
        self._chunk_s[step] = self._chunk_s.get(step, 0.0) + span["seconds"]
        return chunk

    def finish(self, step: int, kl_coef: float) -> tuple[Experience, dict]:
        """Fused schedule: advantages over the whole batch once every chunk is assessed."""
        chunks = self._chunks.pop(step)
        parts = [chunks[c] for c in sorted(chunks)]  # in the stream's order
        with self.spans.span("assessment", step, self._lane(), chunk="merge") as span:
            samples = merge_samples([b.samples for b, _, _ in parts], self.pad_id)
            width = samples.rollout.response_ids.shape[1]
            ref = [pad_right(r, width) for _, r, _ in parts]
            val = [pad_right(v, width) for _, _, v in parts]
            baselines = [b.baseline for b, _, _ in parts]
            exp = assess_from(samples, None if ref[0] is None else torch.cat(ref),
                              None if val[0] is None else torch.cat(val), kl_coef,
                              None if baselines[0] is None else torch.cat(baselines), self.cfg)
        return exp, self._info(exp, span["seconds"] + self._chunk_s.pop(step, 0.0))


# -- the process ----------------------------------------------------------------------------

class GroupWorker:
    """One process of a device group, hosting the roles named in `roles`."""

    def __init__(self, cfg: RunConfig, model_path: str, group: str, rank: int,
                 roles: tuple[str, ...], threads: int) -> None:
        unknown = set(roles) - set(STAGE_ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}")
        torch.set_num_threads(threads)
        self.group, self.rank, self.roles = group, rank, roles
        self.spans = SpanLog(group)
        path = Path(model_path)
        needs_pool = cfg.data.task == "code" and {"generation", "training"} & set(roles)
        self.pool = SandboxPool(cfg.reward.sandbox_workers) if needs_pool else None
        self.training = (TrainingRole(cfg, path, self.spans, self.pool)
                         if "training" in roles else None)
        self.generation = (GenerationRole(cfg, path, self.spans, self.pool, self.training)
                           if "generation" in roles else None)
        self.assessment = (AssessmentRole(cfg, path, self.spans, self.training)
                           if "assessment" in roles else None)

    # control calls (answered while a stage runs)
    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "group": self.group,
                "rank": self.rank}

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def receive_weights(self, step: int, version: int, state: dict[str, torch.Tensor],
                        timeout_s: float) -> dict[str, float]:
        """Publish the trainer's policy into the generation copy's free buffer."""
        return self._receive(self.generation.weights, "policy", step, version, state, timeout_s)

    def receive_critic(self, step: int, version: int, state: dict[str, torch.Tensor],
                       timeout_s: float) -> dict[str, float]:
        return self._receive(self.assessment.critic, "critic", step, version, state, timeout_s)

    def _receive(self, shadow: ShadowModel, what: str, step: int, version: int,
                 state: dict[str, torch.Tensor], timeout_s: float) -> dict[str, float]:
        with self.spans.span("weight_sync", step, "sync", what=what, version=version):
            stats: SyncStats = shadow.publish(version, state, timeout_s)
        return {"bytes": stats.bytes, "seconds": stats.seconds, "wait_s": stats.wait_s}

    # stage calls (default thread, in submission order)
    def generate(self, step: int, prompts: int | None = None) -> tuple[Batch, dict]:
        return self.generation.generate(step, prompts)

    def assess(self, step: int, batch: Batch, kl_coef: float) -> tuple[Experience, dict]:
        return self.assessment.assess(step, batch, kl_coef)

    def assess_chunk(self, step: int, chunk: int, batch: Batch) -> int:
        return self.assessment.assess_chunk(step, chunk, batch)

    def finish_assessment(self, step: int, kl_coef: float, *chunks: int
                          ) -> tuple[Experience, dict]:
        return self.assessment.finish(step, kl_coef)

    def train(self, step: int, exp: Experience, kl_coef: float, correct: bool) -> dict:
        return self.training.train(step, exp, kl_coef, correct)

    def evaluate(self, step: int) -> float:
        return self.training.evaluate(step)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return self.training.policy.state_dict()

    def critic_weights(self) -> dict[str, torch.Tensor]:
        t = self.training
        return (t.critic if t.critic is not None else t.policy).state_dict()

    def training_state(self) -> dict[str, Any]:
        return self.training.state()

    def generation_state(self) -> dict[str, Any]:
        return self.generation.state()

    def load_state(self, state: dict[str, Any]) -> None:
        if self.training is not None:
            self.training.load_state(state)
        if self.generation is not None:
            self.generation.load_state(state)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
