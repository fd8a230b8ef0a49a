"""The stages a rank hosts (generation, assessment, training) with the models, streams and
RNGs each needs, built with the single-process loaders and seeds over the rank's group
(`ranks.RankGroup`); the batch that passes between them. No Ray here: a
`worker.GroupWorker` hosts the stages its group runs."""
from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.lr_schedule import lr_factor
from rlloom.algos.presets import PRESETS
from rlloom.algos.rollout_correction import recomputes_behaviour
from rlloom.config import RunConfig
from rlloom.data.preferences import read_preference_file
from rlloom.data.prompts import PromptStream, load_prompt_sets
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.hf_io import DTYPES, load_model, load_tokenizer
from rlloom.models.lora import adapters_disabled
from rlloom.parallel.apply import load_sharded, save_sharded
from rlloom.parallel.pipeline import PipelinedModel
from rlloom.plan import DeviceGroup, generation_layout, model_layout, needs_generation_copy
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rollout.multi_turn import Tools
from rlloom.rollout.partial import PartialPool
from rlloom.runtime.checkpoint import load_whole_state, whole_state
from rlloom.runtime.device import compute_dtype, compute_precision, frozen_dtype
from rlloom.runtime.executor.corrections import Rows, decoupled, sampler_corrected
from rlloom.runtime.executor.policy import build_critic, build_policy
from rlloom.runtime.executor.weight_sync import ShadowModel, synced_state
from rlloom.runtime.outputs.spans import SpanLog
from rlloom.runtime.ranks import RankGroup, Share, reshard
from rlloom.runtime.stages.evaluate import eval_problems, evaluate_policy
from rlloom.runtime.stages.experience import Experience
from rlloom.runtime.stages.generation import (
    Rewarder,
    Samples,
    engine_syncs,
    generate_group,
    greedy_baseline,
)
from rlloom.runtime.stages.offline import preference_eval, preference_step
from rlloom.runtime.stages.online import (
    assess_from,
    behaviour_kl,
    optimise,
    scores,
)

# -- batches and stage helpers (no Ray, unit-tested directly) -------------------------------

@dataclass
class Batch:
    """What generation hands to assessment: scored groups, the ReMax baseline, and the weight
    version that sampled them."""
    samples: Samples
    baseline: torch.Tensor | None  # [n] ReMax greedy reward, else None
    version: int


# -- the stages a rank hosts ---------------------------------------------------------------

def copy_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """The dtype of every model copy that does not train (reference, generation and critic
    copies) and of the weights weight sync sends them: the compute dtype (`frozen_dtype`),
    so sender and receivers agree and the channel carries half an fp32 model's bytes."""
    return frozen_dtype(cfg.train.compute_dtype, DTYPES[cfg.model.dtype], device)


def staging_device(cfg: RunConfig, ranks: RankGroup) -> torch.device:
    """Where a colocated actor's generation copy lives: with vLLM, which loads its own weights
    onto the device, in host memory (the copy only stages the weights vLLM reloads, and
    evaluation generates on vLLM too); else on the rank's device."""
    return torch.device("cpu") if cfg.rollout.engine == "vllm" else ranks.device


def _in_compute_dtype(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a stage under `train.compute_dtype` (autocast is per thread: each call sets it)."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with compute_precision(self.cfg.train.compute_dtype, self.ranks.device):
            return method(self, *args, **kwargs)
    return run


class LiveModel:
    """The trainer's own weights, read in place (generation in the trainer's process): its
    generation copy for the actor, its critic (or shared actor-critic) for values."""

    def __init__(self, training: TrainingHost, critic: bool = False) -> None:
        self.training, self.critic = training, critic

    @contextmanager
    def read(self) -> Iterator[tuple[int, torch.nn.Module]]:
        t = self.training
        if self.critic:
            yield t.version, t.critic if t.critic is not None else t.policy
        else:
            yield t.version, t.generator


def _shadow(build: Callable[[], torch.nn.Module | PipelinedModel], ranks: RankGroup,
            whole: Mapping[str, torch.Tensor] | None = None) -> ShadowModel:
    """A double-buffered copy; a sharded one is built twice (a deep copy of a sharded model
    would share its meshes' state). `whole`: see `ShadowModel`."""
    return ShadowModel(build(), twin=build() if ranks.world > 1 else None, whole=whole)


class TrainingHost:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog,
                 pool: SandboxPool | None, ranks: RankGroup, generates: bool) -> None:
        self.cfg, self.spans, self.pool, self.ranks = cfg, spans, pool, ranks
        a, plan = cfg.algo, cfg.plan
        self.layout = plan.layout("actor")
        self.critic_layout = plan.layouts.get("critic", self.layout)
        self.policy = build_policy(cfg, model_path).to(ranks.device)
        self.tokenizer = load_tokenizer(model_path, cfg.data.chat_template)
        self.critic: ValueModel | None = None
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if "critic" in PRESETS[a.name].roles and plan.actor_critic != "shared":
            self.critic = build_critic(self.cfg.model, model_path, self.policy).to(ranks.device)
        # generation beside training (and held-out evaluation) reads the policy itself, or a
        # copy in its own layout: always when the actor trains data-parallel (see
        # ranks.RankGroup.generating), on sequence shards, which a KV cache cannot decode, or
        # in pipeline stages, which hold some layers each
        gen = generation_layout(plan) if generates else self.layout
        self.generator = self.policy
        if ranks.world > 1 and (self.layout.cp > 1 or self.layout.pp > 1 or (
                generates and needs_generation_copy(self.layout, gen))):  # the priced rule
            # in the dtype the trainer's data parallelism gathers its weights in, so both
            # compute with the same weights
            held = copy_dtype(cfg, ranks.device)
            self.generator = ranks.generating(
                copy.deepcopy(self.policy).to(staging_device(cfg, ranks), held), gen)
        compute = compute_dtype(cfg.train.compute_dtype, ranks.device)
        # with pp > 1 the policy that trains is this rank's pipeline stage
        self.policy, self.optimizer = ranks.trained(self.policy, self.layout, cfg.train.lr,
                                                    compute,
                                                    weight_decay=cfg.train.weight_decay)
        if self.critic is not None:
            self.critic, self.critic_optimizer = ranks.trained(self.critic, self.critic_layout,
                                                               a.critic_lr, compute)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.eval_set = eval_problems(cfg)
        self.tools = Tools.of(cfg.rollout, cfg.reward.sandbox_isolation)
        self.version = 0  # optimizer steps taken: the weight version
        # `optimise` calls the plain loss; decoupled_ppo is run through it (see `decoupled`)
        self.opt_cfg = (cfg.model_copy(update={"algo": a.model_copy(
            update={"policy_loss": "ppo"})}) if a.policy_loss == "decoupled_ppo" else cfg)

    @property
    def parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        def own(model: torch.nn.Module | PipelinedModel) -> torch.nn.Module:
            return model.module if isinstance(model, PipelinedModel) else model  # its stage
        parts = {"actor": (own(self.policy), self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (own(self.critic), self.critic_optimizer)
        return parts

    def set_lr(self, step: int) -> float:
        """Every optimizer at its base rate times the schedule's factor for `step`."""
        t = self.cfg.train
        factor = lr_factor(step, t.steps, t.lr_schedule, t.warmup_steps, t.min_lr_ratio)
        for optim, base in ((self.optimizer, t.lr),
                            (self.critic_optimizer, self.cfg.algo.critic_lr)):
            for group in optim.param_groups if optim is not None else ():
                group["lr"] = base * factor
        return t.lr * factor

    @_in_compute_dtype
    def train(self, step: int, exp: Experience, kl_coef: float, correct: bool
              ) -> dict[str, Any]:
        lane = "actor+critic" if self.critic is not None else "actor"
        extra: dict[str, float] = {"lr": self.set_lr(step)}
        exp = exp.to(self.ranks.device)
        with self.spans.span("training", step, lane) as span:
            a, r = self.cfg.algo, self.ranks
            rows = Rows(self.cfg.train.micro_batch_tokens, r, r.share(self.layout))
            if correct:
                exp, extra["behaviour_kl"] = decoupled(exp, self.policy,
                                                       self.cfg.rollout.temperature, rows)
            elif recomputes_behaviour(self.cfg.rollout.engine, a.rollout_is):
                exp, mismatch = sampler_corrected(exp, self.policy, self.cfg.rollout.temperature,
                                                  rows, a.rollout_is, a.rollout_is_cap)
                extra.update(mismatch)
            stats = optimise(self.policy, self.optimizer, exp, self.critic,
                             self.critic_optimizer, kl_coef, self.opt_cfg, self.shuffle_gen,
                             r.share(self.layout), r.share(self.critic_layout), r.agree())
            stats = r.mean({**stats, **extra})
        self.version = step
        if self.generator is not self.policy:
            stats["reshard_s"], stats["reshard_bytes"] = reshard(self.policy, self.generator)
        return {**stats, "train_s": span["seconds"], "version": step}

    @_in_compute_dtype
    def evaluate(self, step: int) -> dict[str, float] | None:
        if not self.eval_set:
            return None
        with self.spans.span("eval", step, "eval"):
            return evaluate_policy(self.generator, self.tokenizer, self.eval_set, self.cfg,
                                   self.pool, self.tools)

    def state(self) -> dict[str, Any]:
        """The loop state, with whole weights and optimizer state when one rank holds them
        (a group of ranks writes shards instead: `save_shards`)."""
        state: dict[str, Any] = {"shuffle_gen": self.shuffle_gen.get_state()}
        if self.ranks.world == 1:
            state.update(whole_state(self.parts))
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        self.version = state["step"]
        self.shuffle_gen.set_state(state["shuffle_gen"])
        if "policy" in state:
            load_whole_state(self.parts, state)

    def save_shards(self, path: Path) -> None:
        for name, (model, optim) in self.parts.items():
            save_sharded(model, optim, path / name)

    def load_shards(self, path: Path) -> None:
        for name, (model, optim) in self.parts.items():
            load_sharded(model, optim, path / name)
        if self.generator is not self.policy:
            reshard(self.policy, self.generator)


class GenerationHost:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog,
                 pool: SandboxPool | None, ranks: RankGroup, training: TrainingHost | None
                 ) -> None:
        self.cfg, self.spans, self.ranks = cfg, spans, ranks
        self.tokenizer = load_tokenizer(model_path, cfg.data.chat_template)
        layout = generation_layout(cfg.plan)
        held = copy_dtype(cfg, ranks.device)
        self.weights: LiveModel | ShadowModel = LiveModel(training) if training else _shadow(
            lambda: ranks.generating(build_policy(cfg, model_path).to(ranks.device, held),
                                     layout), ranks)
        self.rewarder = Rewarder.build(cfg, self.tokenizer, pool, ranks.device)
        self.stream = PromptStream(load_prompt_sets(cfg.data, cfg.seed).train, cfg.seed)
        self.share = ranks.share(layout)
        # replicas sample their own prompts with their own streams; replica 0's is the one
        # process's, so a one-replica group samples what `rlloom train` samples
        self.sample_gen = torch.Generator().manual_seed(cfg.seed + self.share.part)
        self.greedy = "greedy_baseline" in ADVANTAGES.needs(cfg.algo.advantage)
        r = cfg.rollout
        self.pool = PartialPool(r.partial_tokens, r.max_new_tokens) if r.partial_tokens else None
        self.tools = Tools.of(r, cfg.reward.sandbox_isolation)

    @_in_compute_dtype
    def generate(self, step: int, prompts: int | None = None
                 ) -> tuple[Batch, dict[str, Any]]:
        """A step's B prompts x K samples (`collect`, with dynamic sampling), or, for a fused
        schedule, the next chunk of `prompts` prompts; the weights are read once, at the
        start, so a request never mixes versions. Every rank returns the whole batch (on the
        CPU)."""
        cfg = self.cfg
        # each turn's tool calls, a span of their own in this step
        tools = self.tools and replace(self.tools, span=functools.partial(
            self.spans.span, "tools", step, "tools"))
        with self.weights.read() as (version, policy):
            with self.spans.span("generation", step, "actor", version=version) as span:
                samples = generate_group(policy, self.tokenizer, self.stream, cfg,
                                         self.rewarder, self.sample_gen, self.ranks, self.share,
                                         prompts, self.pool, version, tools)
                baseline = (greedy_baseline(policy, self.tokenizer, samples, cfg, self.rewarder)
                            if self.greedy else None)
        batch = Batch(samples.to("cpu"), None if baseline is None else baseline.cpu(), version)
        tokens = samples.rollout.response_lengths.sum().item()
        sync_s, sync_bytes = engine_syncs()  # a vLLM server's reloads of new weights
        return batch, {
            "engine_sync_s": sync_s, "engine_sync_bytes": sync_bytes,
            "version": version, "gen_s": span["seconds"] - samples.score_s,
            "score_s": samples.score_s, "rollouts": len(samples.scores), "tokens": tokens,
            "token_version": version if samples.version_sum is None
            else samples.version_sum.sum().item() / max(tokens, 1)}

    def state(self) -> dict[str, Any]:
        return {**self.ranks.sampling_state(self.sample_gen),
                "data_position": self.stream.position,
                **({"partial_pool": self.pool.state()} if self.pool else {})}

    def load_state(self, state: dict[str, Any]) -> None:
        self.ranks.load_sampling_state(self.sample_gen, state)
        self.stream.position = state["data_position"]
        if self.pool:
            self.pool.load_state(state["partial_pool"])


class AssessmentHost:
    def __init__(self, cfg: RunConfig, model_path: Path, spans: SpanLog, ranks: RankGroup,
                 group: DeviceGroup, training: TrainingHost | None) -> None:
        self.cfg, self.spans, self.ranks = cfg, spans, ranks
        a, plan = cfg.algo, cfg.plan
        dtype = copy_dtype(cfg, ranks.device)
        ref_layout = model_layout(plan, group, "reference")
        self.ref_share = ranks.share(ref_layout)
        self.reference: nn.Module | None = None
        if cfg.needs_reference and cfg.model.lora is not None and training is not None:
            # the reference is the base model: the policy with its adapters switched off
            # (`adapters_disabled` around each use), not a second copy of the weights
            self.reference, self.ref_share = training.policy, ranks.share(training.layout)
        elif cfg.needs_reference:
            self.reference = ranks.frozen(load_model(model_path, dtype).to(ranks.device).eval()
                                          .requires_grad_(False), ref_layout)
        self.critic: LiveModel | ShadowModel | None = None
        self.critic_share = Share()
        if "critic" in PRESETS[a.name].roles:
            if training is not None:
                self.critic = LiveModel(training, critic=True)
                self.critic_share = ranks.share(training.critic_layout if training.critic
                                                else training.layout)
            else:  # a copy of the trainer's critic, refreshed by weight sync after each step
                layout = model_layout(plan, group, "critic")
                self.critic_share = ranks.share(layout)
                whole: dict[str, torch.Tensor] = {}   # what the trainer sends: every tensor

                def build() -> torch.nn.Module | PipelinedModel:
                    policy = build_policy(cfg, model_path)
                    critic = (policy if isinstance(policy, ActorCritic)
                              else build_critic(cfg.model, model_path, policy))
                    critic = critic.to(ranks.device, dtype)
                    whole.update({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                                  for k, v in synced_state(critic).items()})
                    return ranks.frozen(critic, layout)
                self.critic = _shadow(build, ranks, whole)
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
                "samples": exp.samples.stats()}

    def _out(self, exp: Experience, seconds: float) -> tuple[Experience, dict]:
        """The experience on the CPU (every rank computed the same) and what the stage did."""
        return exp.to("cpu"), self._info(exp, seconds)

    def _scores(self, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with self._critic() as critic, adapters_disabled(self.reference):
            return scores(batch.samples.to(self.ranks.device), self.reference, critic, self.cfg,
                          self.ranks, self.ref_share, self.critic_share)

    @_in_compute_dtype
    def assess(self, step: int, batch: Batch, kl_coef: float) -> tuple[Experience, dict]:
        with self.spans.span("assessment", step, self._lane()) as span:
            samples = batch.samples.to(self.ranks.device)
            baseline = None if batch.baseline is None else batch.baseline.to(self.ranks.device)
            exp = assess_from(samples, *self._scores(batch), kl_coef, baseline, self.cfg)
        return self._out(exp, span["seconds"])

    @_in_compute_dtype
    def assess_chunk(self, step: int, chunk: int, batch: Batch) -> int:
        """Fused schedule: the forward passes of one chunk, as soon as it is generated."""
        with self.spans.span("assessment", step, self._lane(), chunk=chunk) as span:
            ref_logp, values = self._scores(batch)
        self._chunks.setdefault(step, {})[chunk] = (batch, ref_logp, values)
        self._chunk_s[step] = self._chunk_s.get(step, 0.0) + span["seconds"]
        return chunk

    @_in_compute_dtype
    def finish(self, step: int, kl_coef: float) -> tuple[Experience, dict]:
        """Fused schedule: advantages over the whole batch once every chunk is assessed."""
        chunks = self._chunks.pop(step)
        parts = [chunks[c] for c in sorted(chunks)]  # in the stream's order
        device = self.ranks.device
        with self.spans.span("assessment", step, self._lane(), chunk="merge") as span:
            samples = Samples.cat([b.samples for b, _, _ in parts], self.pad_id).to(device)
            width = samples.rollout.response_ids.shape[1]

            def joined(outs: list[torch.Tensor | None]) -> torch.Tensor | None:
                if outs[0] is None:
                    return None
                return torch.cat([nn.functional.pad(x, (0, width - x.shape[1])) for x in outs])
            baselines = [b.baseline for b, _, _ in parts]
            exp = assess_from(samples, joined([r for _, r, _ in parts]),
                              joined([v for _, _, v in parts]), kl_coef,
                              None if baselines[0] is None else torch.cat(baselines).to(device),
                              self.cfg)
        return self._out(exp, span["seconds"] + self._chunk_s.pop(step, 0.0))


class PreferenceHost:
    """Offline training (DPO-style): preference pairs take the place of generation and
    assessment; the policy and the frozen reference are the training and assessment hosts'."""

    def __init__(self, cfg: RunConfig, spans: SpanLog, training: TrainingHost,
                 assessment: AssessmentHost) -> None:
        self.cfg, self.spans, self.ranks = cfg, spans, training.ranks
        self.training, self.assessment = training, assessment
        d = cfg.data
        self.pairs = PromptStream(read_preference_file(d.preference_file, d.transform,
                                                       d.system_prompt), cfg.seed)
        self.eval_pairs = (read_preference_file(d.eval_file, d.transform, d.system_prompt)
                           if d.eval_file else [])

    @_in_compute_dtype
    def train(self, step: int) -> dict[str, Any]:
        t, cfg = self.training, self.cfg
        pairs = self.pairs.next(cfg.train.prompts_per_step)
        lr = t.set_lr(step)
        with self.spans.span("training", step, "actor+reference") as span:
            stats = preference_step(t.policy, self.assessment.reference, t.optimizer,
                                    t.tokenizer, pairs, cfg.algo, cfg.train.grad_clip,
                                    cfg.train.on_nonfinite)
        t.version = step
        return {**stats, "lr": lr, "train_s": span["seconds"]}

    @_in_compute_dtype
    def evaluate(self, step: int) -> dict[str, float]:
        t = self.training
        with self.spans.span("eval", step, "eval"):
            return preference_eval(t.policy, self.assessment.reference, t.tokenizer,
                                   self.eval_pairs, self.cfg.algo)

    def state(self) -> dict[str, Any]:
        return {"data_position": self.pairs.position}

    def load_state(self, state: dict[str, Any]) -> None:
        self.pairs.position = state["data_position"]


# -- what every driver reports and writes ----------------------------------------------------

def step_row(ginfo: dict[str, Any], ainfo: dict[str, Any], stats: dict[str, Any],
             kl_coef: float) -> tuple[dict[str, Any], float]:
    """A step's metrics row from what its stages report (`GenerationHost.generate`,
    `AssessmentHost.assess`, `TrainingHost.train`), and the behaviour policy's KL to the
    reference, which adaptive KL tracks. Rewards are scored as samples finish (dynamic
    sampling needs them): Assessment work, though it runs inside generation."""
    stats = dict(stats)
    kl_now = ainfo["behaviour_kl_ref"]
    train_s = stats.pop("train_s")
    stats.pop("version")
    row = {**ainfo["samples"], "kl": stats.pop("kl", kl_now), "kl_coef": kl_coef, **stats,
           "gen_s": ginfo["gen_s"], "assess_s": ainfo["assess_s"] + ginfo["score_s"],
           "train_s": train_s}
    return row, kl_now
