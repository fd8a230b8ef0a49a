"""The Generation stage of an online step: scored samples of whole prompt groups (`Samples`),
the reward terms (`Rewarder`: the task's verifier, a reward model, Python reward functions),
and the sampling of a step's groups on a generation group's ranks, with dynamic sampling,
partial rollouts and ReMax's greedy baseline."""
from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.dapo import groups_with_signal
from rlloom.config import RunConfig
from rlloom.config_sections import RolloutSection
from rlloom.data.chat import is_chat
from rlloom.data.prompts import PromptStream
from rlloom.data.synthetic import Problem, row_columns
from rlloom.models.heads import ValueModel
from rlloom.models.hf_io import DTYPES, load_value_model, require_policy_tokenizer
from rlloom.models.transformer import CausalLM
from rlloom.rewards import functions as reward_functions
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rewards.tasks import task_terms
from rlloom.rollout.engine import EngineConfig, engine_generate
from rlloom.rollout.generate import Rollout, cat_rollouts, generate, maybe
from rlloom.rollout.multi_turn import Dialogue, Tools
from rlloom.rollout.partial import PartialPool
from rlloom.rollout.partial_rule import partial_step
from rlloom.rollout.sampling import SamplingParams, StopMatcher
from rlloom.rollout.tools import CALL_END
from rlloom.rollout.vllm_engine import VLLMEngine, gpu_memory_args
from rlloom.rollout.vllm_env import resolve_python
from rlloom.runtime.device import kv_budget_bytes, model_device
from rlloom.runtime.ranks import RankGroup, Share
from rlloom.runtime.stages.batch import (
    decode_responses,
    encode,
    sequence_scores,
)


@dataclass
class Samples:
    """Scored rollouts of whole groups (the K samples of each prompt are adjacent)."""
    problems: list[Problem]
    rollout: Rollout
    group_ids: torch.Tensor     # [n] index into `problems`
    terms: dict[str, torch.Tensor]  # reward term -> [n]
    scores: torch.Tensor        # [n] weighted sum of the terms
    rounds: int = 1             # generation rounds it took (dynamic sampling)
    score_s: float = 0.0        # seconds spent computing rewards (part of Assessment)
    # [n] the weight versions of each response's tokens, summed (partial rollouts mix
    # versions in one response); None: every token has the batch's one version
    version_sum: torch.Tensor | None = None
    # [n, 4] multi-turn rollouts' turns, tool calls, tool errors, tool seconds (None:
    # single-turn); metrics, so they stay on the CPU
    tools: torch.Tensor | None = None

    def stats(self) -> dict[str, Any]:
        """The per-step sample metrics of metrics.jsonl (the lengths feed `perf validate`)."""
        r = self.rollout
        return {"reward": self.scores.mean().item(),
                **{f"reward/{k}": v.float().mean().item() for k, v in self.terms.items()},
                **group_spread(self.scores, self.group_ids),
                # the share with the verifier's full marks, where a verifier defines it
                **({"accuracy": (self.terms["correct"] >= 1.0).float().mean().item()}
                   if "correct" in self.terms else {}),
                "response_len": r.response_lengths.float().mean().item(),
                "truncated": (~r.finished).float().mean().item(),
                "sample_rounds": self.rounds,
                "prompt_len": r.prompt_mask.sum(1).float().mean().item(),
                "response_lens": r.response_lengths.tolist(), **self._tool_stats()}

    def _tool_stats(self) -> dict[str, float]:
        if self.tools is None:
            return {}
        turns, calls, errors, seconds = self.tools.sum(0).tolist()
        n = len(self.tools)
        return {"turns": turns / n, "tool_calls": calls / n, "tool_errors": errors / n,
                "tool_success": (calls - errors) / calls if calls else 0.0,
                "tool_s": seconds}

    def to(self, device: torch.device | str) -> "Samples":
        return replace(self, rollout=self.rollout.to(device),
                       group_ids=self.group_ids.to(device),
                       terms={k: v.to(device) for k, v in self.terms.items()},
                       scores=self.scores.to(device),
                       version_sum=maybe(lambda v: v.to(device), self.version_sum))

    @classmethod
    def cat(cls, parts: list["Samples"], pad_id: int) -> "Samples":
        """Batches of whole groups as one, in order (group ids renumbered, responses
        re-padded); rounds is the most any part took, score_s their sum."""
        offsets, groups = [], 0
        for s in parts:
            offsets.append(groups)
            groups += len(s.problems)
        return cls([p for s in parts for p in s.problems],
                   cat_rollouts([s.rollout for s in parts], pad_id),
                   torch.cat([s.group_ids + o for s, o in zip(parts, offsets)]),
                   {k: torch.cat([s.terms[k] for s in parts]) for k in parts[0].terms},
                   torch.cat([s.scores for s in parts]), max(s.rounds for s in parts),
                   sum(s.score_s for s in parts),
                   None if parts[0].version_sum is None
                   else torch.cat([s.version_sum for s in parts]),
                   None if parts[0].tools is None else torch.cat([s.tools for s in parts]))

    def groups(self, keep: list[int]) -> "Samples":
        """The groups `keep` (indices into `problems`), renumbered from 0 in that order."""
        idx = torch.cat([(self.group_ids == g).nonzero().squeeze(1) for g in keep])
        new_ids = torch.cat([torch.full(((self.group_ids == g).sum(),), i, dtype=torch.long,
                                        device=idx.device) for i, g in enumerate(keep)])
        return replace(self, problems=[self.problems[g] for g in keep],
                       rollout=self.rollout.select(idx), group_ids=new_ids,
                       terms={k: v[idx] for k, v in self.terms.items()},
                       scores=self.scores[idx],
                       version_sum=maybe(lambda v: v[idx], self.version_sum),
                       tools=maybe(lambda v: v[idx.cpu()], self.tools))


def group_spread(scores: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """TRL's `reward_std` (the mean over groups of the group's unbiased reward std) and the
    share of groups whose rewards are all equal, which give no learning signal."""
    groups = [scores[group_ids == g] for g in group_ids.unique()]
    return {"reward_std": sum(g.std().item() if len(g) > 1 else 0.0 for g in groups)
            / len(groups),
            "frac_zero_std_groups": sum(bool(g.max() == g.min()) for g in groups) / len(groups)}


class Rewarder:
    """Reward terms of responses: the task's verifier (with a sandbox pool for code), the
    user's functions (one named like a verifier term, `correct` or `format`, replaces it,
    `accuracy` included) and an optional reward model, combined by `reward.weights`."""

    def __init__(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase,
                 reward_model: ValueModel | None, pool: SandboxPool | None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.reward_model, self.pool = reward_model, pool
        self.functions = [reward_functions.load(spec) for spec in cfg.reward.functions]

    @classmethod
    def build(cls, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, pool: SandboxPool | None,
              device: torch.device) -> "Rewarder":
        """The run's rewarder, with its reward model (when `reward.model_path` is set) loaded
        frozen on `device`; the model must share the policy's tokenizer."""
        model = None
        if cfg.reward.model_path:
            model = load_value_model(cfg.reward.model_path, DTYPES[cfg.model.dtype]).to(
                device).eval().requires_grad_(False)
            require_policy_tokenizer(cfg.reward.model_path, model.config.vocab_size, tokenizer,
                                     "reward model")
        return cls(cfg, tokenizer, model, pool)

    def terms(self, problems: list[Problem], group_ids: torch.Tensor, rollout: Rollout
              ) -> dict[str, torch.Tensor]:
        """Each term [n], on the rollout's device (the verifiers run on the host)."""
        texts = decode_responses(self.tokenizer, rollout)
        per_sample = [problems[g] for g in group_ids.tolist()]
        device = rollout.response_ids.device
        terms = {k: torch.tensor(v, device=device) for k, v in
                 task_terms(per_sample, texts, self.cfg.data.task, self.pool,
                            self.cfg.reward.code_score).items()}
        if self.functions:
            ids = [row[mask.bool()].tolist() for row, mask in
                   zip(rollout.response_ids.cpu(), rollout.response_mask.cpu())]
            columns = row_columns(per_sample)
            sources = [p.source for p in per_sample]
            # TRL's convention: a chat prompt's completion is the assistant turn
            completions = [[{"role": "assistant", "content": t}] if is_chat(p.prompt) else t
                           for p, t in zip(per_sample, texts)]
            for name, fn in self.functions:
                terms[name] = torch.tensor(reward_functions.call(
                    name, fn, [p.prompt for p in per_sample], completions, ids, columns,
                    sources, self.cfg.reward.timeout_s, self.cfg.reward.retries), device=device)
        if self.reward_model is not None:
            with torch.no_grad():
                terms["model"] = sequence_scores(self.reward_model, rollout).float()
        return terms

    def score(self, problems: list[Problem], group_ids: torch.Tensor, rollout: Rollout
              ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        terms = self.terms(problems, group_ids, rollout)
        total = sum(w * terms[k] for k, w in self.cfg.reward.weights.items())
        return terms, total



def _params(r: RolloutSection, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens, r.temperature, r.top_p, r.top_k, r.min_p,
                          r.repetition_penalty, stop=tuple(r.stop))


def _rollout(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
             params: SamplingParams, cfg: RunConfig, generator: torch.Generator,
             n_samples: int, dialogue: Dialogue | None = None) -> Rollout:
    r = cfg.rollout
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    replay = cfg.algo.routing_replay == "replay"  # each token's experts (rollout/routes.py)
    if r.engine == "vllm":
        engine = vllm_engine(policy, tokenizer, cfg)

        def on_vllm(rows: list[list[int]], room: int) -> Rollout:
            return engine.generate(rows, replace(params, max_new_tokens=room), eos, pad,
                                   generator)
        if dialogue is not None:
            return dialogue.converse(on_vllm, prompts, pad)
        return on_vllm(prompts, params.max_new_tokens)
    if r.engine == "plain":
        def turn(rows: list[list[int]], room: int) -> Rollout:
            return generate(policy, rows, replace(params, max_new_tokens=room), eos, pad,
                            generator, decode=tokenizer.decode, record_routes=replay)
        if dialogue is not None:
            return dialogue.converse(turn, prompts, pad)
        return turn(prompts, params.max_new_tokens)
    # a sharded model falls back to the plain loop inside the engine
    engine = EngineConfig(max_batch=r.max_batch, n_samples=n_samples,
                          kv_budget_bytes=kv_budget_bytes(model_device(policy)),
                          record_routes=replay)
    return engine_generate(policy, prompts, params, eos, pad, generator, engine,
                           tokenizer.decode, dialogue)


_VLLM: list[VLLMEngine] = []   # this process's vLLM server, once started


def vllm_engine(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, cfg: RunConfig
                ) -> VLLMEngine:
    """This process's vLLM server (started on first use, closed at exit), generating with
    `policy`'s weights: the model a call passes, whichever copy of the weights it is."""
    if not _VLLM:
        r = cfg.rollout
        # the rank's GPU, where vLLM runs, even when the copy it reloads from is in host
        # memory (`hosts.staging_device`)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else model_device(policy)
        length = policy.config.max_position_embeddings
        gpu = None if device.type != "cuda" else gpu_memory_args(
            policy, kv_budget_bytes(device), torch.cuda.get_device_properties(device).total_memory,
            length)
        engine = VLLMEngine(policy, tokenizer, resolve_python(r.vllm_python), r.temperature,
                            max_model_len=length, max_num_seqs=r.max_batch or 256,
                            seed=cfg.seed, gpu_memory=gpu)
        atexit.register(engine.close)
        _VLLM.append(engine)
    _VLLM[0].policy = policy
    return _VLLM[0]


def engine_syncs() -> tuple[float, int]:
    """Seconds and bytes of the weight reloads this process's vLLM server took since the
    last call (zeros without vLLM)."""
    records = _VLLM[0].take_syncs() if _VLLM else []
    return sum(r.seconds for r in records), sum(r.bytes for r in records)


def respond(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
            params: SamplingParams, cfg: RunConfig, generator: torch.Generator | None,
            n_samples: int, tools: Tools | None) -> tuple[Rollout, torch.Tensor | None]:
    """One response per prompt: a single turn, or with `tools` a conversation of turns and
    tool results (`multi_turn.Dialogue`), and then its per-row tool stats."""
    if tools is None:
        return _rollout(policy, tokenizer, prompts, params, cfg, generator, n_samples), None
    dialogue = Dialogue(tools, len(prompts), params.max_new_tokens, tokenizer.decode,
                        lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    rollout = _rollout(policy, tokenizer, prompts, replace(params, stop=(*params.stop, CALL_END)),
                       cfg, generator, n_samples, dialogue)
    return rollout.to(model_device(policy)), dialogue.stats()


def _scored(problems: list[Problem], rollout: Rollout, k: int, rewarder: Rewarder,
            versions: torch.Tensor | None = None, tools: torch.Tensor | None = None
            ) -> Samples:
    group_ids = torch.arange(len(problems), device=rollout.finished.device).repeat_interleave(k)
    t0 = time.perf_counter()
    terms, scores = rewarder.score(problems, group_ids, rollout)
    return Samples(problems, rollout, group_ids, terms, scores,
                   score_s=time.perf_counter() - t0, version_sum=versions, tools=tools)


def sample_groups(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
                  cfg: RunConfig, rewarder: Rewarder, generator: torch.Generator,
                  tools: Tools | None = None) -> Samples:
    k = cfg.rollout.n_samples
    prompts = [ids for ids in encode(tokenizer, [p.prompt for p in problems]) for _ in range(k)]
    params = _params(cfg.rollout, cfg.rollout.max_new_tokens)
    rollout, stats = respond(policy, tokenizer, prompts, params, cfg, generator, k, tools)
    return _scored(problems, rollout, k, rewarder, tools=stats)


def partial_groups(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, pool: PartialPool,
                   draw: Callable[[int], list[Problem]], n: int, cfg: RunConfig,
                   rewarder: Rewarder, generator: torch.Generator, version: int,
                   ranks: RankGroup, share: Share) -> Samples:
    """n whole groups from the partial-rollout pool, filled by `partial_step` (`draw` gives
    the prompts it admits; each chunk's pending rows are dealt to the replicas by group and
    the results all-gathered); the oldest complete groups are taken and scored (on every
    rank alike)."""
    k = cfg.rollout.n_samples
    params = _params(cfg.rollout, pool.chunk)
    stops = StopMatcher(params, tokenizer.decode)

    def admit(more: int) -> None:
        problems = draw(more)
        pool.admit(problems, encode(tokenizer, [p.prompt for p in problems]), k)

    def decode_chunk() -> None:
        pending = pool.pending()
        # whole groups dealt round-robin: each replica gets carried and new rows alike
        order = list(dict.fromkeys(pool.rows[i].group for i in pending))
        dealt = set(order[share.part::share.parts])
        mine = [i for i in pending if pool.rows[i].group in dealt]
        part = (_rollout(policy, tokenizer, pool.requests(mine), params, cfg, generator, 0)
                .to("cpu") if mine else None)
        for got in ranks.gather((mine, part) if share.leader else None):
            if got is not None and got[0]:
                pool.absorb(*got, version, stops)

    partial_step(n, lambda: len(pool.complete()), admit, decode_chunk)
    taken, rollout, versions = pool.take(pool.complete()[:n], tokenizer.pad_token_id)
    return _scored(taken, rollout.to(ranks.device), k, rewarder,
                   torch.tensor([float(sum(v)) for v in versions], device=ranks.device))


def collect(sample_round: Callable[[int], Samples], cfg: RunConfig, pad_id: int) -> Samples:
    """B prompts x K samples, each round of `sample_round(prompts)`; with dynamic sampling,
    groups whose rewards are all equal are dropped and fresh prompts generated, for at most
    `algo.max_sample_rounds` rounds."""
    b = cfg.train.prompts_per_step
    first = sample_round(b)
    if not cfg.algo.dynamic_sampling:
        return first
    kept: list[Samples] = []
    batch, rounds, score_s = first, 1, first.score_s
    while True:
        keep = groups_with_signal(batch.scores, batch.group_ids)
        kept += [batch.groups([g]) for g in batch.group_ids[keep].unique().tolist()]
        if len(kept) >= b or rounds == cfg.algo.max_sample_rounds:
            break
        batch = sample_round(b)
        score_s += batch.score_s
        rounds += 1
    kept = kept[:b] or [first.groups([g]) for g in range(b)]  # nothing learnable: round 1
    return replace(Samples.cat(kept, pad_id), rounds=rounds, score_s=score_s)


def generate_group(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, stream: PromptStream,
                   cfg: RunConfig, rewarder: Rewarder, generator: torch.Generator,
                   ranks: RankGroup, share: Share, prompts: int | None = None,
                   pool: PartialPool | None = None, version: int = 0,
                   tools: Tools | None = None) -> Samples:
    """The step's scored samples on every rank of a group (`collect`, with dynamic sampling),
    or a fused schedule's chunk of `prompts` prompts. Each round every rank draws the same
    prompts; each generation replica samples its `share` of them and the shares are
    all-gathered in replica order, so every rank filters the same groups alike. With a
    partial-rollout `pool`, a round takes the pool's oldest complete groups instead
    (`partial_groups`), sampled by weights `version` and earlier."""
    def sample_round(n: int) -> Samples:
        if pool is not None:
            return partial_groups(policy, tokenizer, pool, stream.next, n, cfg, rewarder,
                                  generator, version, ranks, share)
        problems = stream.next(n)
        part = sample_groups(policy, tokenizer, problems[share.of(n)], cfg, rewarder, generator,
                             tools)
        if ranks.world == 1:
            return part
        got = [p for p in ranks.gather(part.to("cpu") if share.leader else None)
               if p is not None]
        # replicas score at the same time: the stage waits for the slowest
        return replace(Samples.cat(got, tokenizer.pad_token_id),
                       score_s=max(p.score_s for p in got)).to(ranks.device)
    return sample_round(prompts) if prompts else collect(sample_round, cfg,
                                                         tokenizer.pad_token_id)


def greedy_baseline(policy: CausalLM, tokenizer: PreTrainedTokenizerBase, s: Samples,
                    cfg: RunConfig, rewarder: Rewarder) -> torch.Tensor:
    """ReMax: the reward of each prompt's greedy response, per sample [n] (ended by the same
    stop strings as the sampled ones, so the verifier scores alike)."""
    rollout = engine_generate(policy, encode(tokenizer, [p.prompt for p in s.problems]),
                              SamplingParams(cfg.rollout.max_new_tokens, 0.0,
                                             stop=tuple(cfg.rollout.stop)),
                              tokenizer.eos_token_id, tokenizer.pad_token_id,
                              decode=tokenizer.decode)
    _, scores = rewarder.score(s.problems, torch.arange(len(s.problems),
                                                        device=rollout.finished.device), rollout)
    return scores[s.group_ids]
