"""Held-out greedy evaluation."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.data.prompts import load_prompt_sets
from rlloom.data.synthetic import Problem
from rlloom.models.transformer import CausalLM
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rewards.tasks import task_terms
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.multi_turn import Tools
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import decode_responses, encode
from rlloom.runtime.stages.generation import respond

EVAL_BATCH = 256


def eval_problems(cfg: RunConfig) -> list[Problem]:
    """The held-out problems: the eval file's, a share of the prompt file's, or the built-in
    task's, except for an offline run on the user's model without prompts of its own (its
    preference pairs carry no answers, and the built-in task says nothing about that model)."""
    d = cfg.data
    if not (PRESETS[cfg.algo.name].online or d.prompt_file or d.eval_file
            or cfg.model.path is None):
        return []
    return load_prompt_sets(d, cfg.seed).eval


def greedy_accuracy(model: CausalLM, tokenizer: PreTrainedTokenizerBase, problems: list[Problem],
                    cfg: RunConfig, pool: SandboxPool | None = None,
                    tools: Tools | None = None) -> float:
    """Fraction of problems whose greedy response (at most `eval.max_new_tokens`, ended by
    `rollout.stop` like the sampled ones; with `tools`, a greedy conversation) gets the
    verifier's full marks."""
    params = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, temperature=0.0,
                            stop=tuple(cfg.rollout.stop))
    correct = 0
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        prompts = encode(tokenizer, [p.prompt for p in chunk])
        if tools is None:
            rollout = engine_generate(model, prompts, params, tokenizer.eos_token_id,
                                      tokenizer.pad_token_id, decode=tokenizer.decode)
        else:
            rollout, _ = respond(model, tokenizer, prompts, params, cfg, None, 0, tools)
        terms = task_terms(chunk, decode_responses(tokenizer, rollout), cfg.data.task, pool)
        correct += sum(c >= 1.0 for c in terms["correct"])
    return correct / len(problems)
