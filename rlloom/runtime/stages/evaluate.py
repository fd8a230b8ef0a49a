"""Held-out evaluation with the run's own reward terms: greedy, or sampled with pass@k."""
from __future__ import annotations

import math

import torch
from transformers import PreTrainedTokenizerBase

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.data.prompts import load_prompt_sets
from rlloom.data.row_files import DataError
from rlloom.data.synthetic import Problem
from rlloom.models.transformer import CausalLM
from rlloom.rewards.sandbox import SandboxPool
from rlloom.rewards.tasks import sandbox_pool
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.multi_turn import Tools
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.device import model_device
from rlloom.runtime.stages.batch import decode_responses, encode
from rlloom.runtime.stages.generation import Rewarder, respond, vllm_engine
from rlloom.user_code import function_name

EVAL_BATCH = 256  # problems per generation call (times eval.n_samples responses)
EVAL_SEED = 424_242  # sampled evaluation draws from its own stream, the same at every eval


def eval_problems(cfg: RunConfig) -> list[Problem]:
    """The held-out problems: the eval file's, a share of the prompt file's, or the built-in
    task's, except for an offline run on the user's model without prompts of its own (its
    preference pairs carry no answers, and the built-in task says nothing about that model)."""
    d, online = cfg.data, PRESETS[cfg.algo.name].online
    if not (online or d.prompt_file or d.eval_file or cfg.model.path is None):
        return []
    if (not online and d.eval_file) or score_term(cfg) is None:
        return []  # the offline run's eval file holds pairs (stages/offline.py scores them)
    return load_prompt_sets(d, cfg.seed).eval


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c pass (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n."""
    return sorted({*(2 ** i for i in range(n.bit_length()) if 2 ** i < n), n})


def score_term(cfg: RunConfig) -> str | None:
    """The reward term whose held-out value is the run's score: `eval.score`, else the
    verifier's `correct` (scored as accuracy), else with `data.task=none` the first of
    `reward.functions`; None when nothing held out can be scored (a reward model alone)."""
    names = [function_name(s) for s in cfg.reward.functions]
    if cfg.eval.score is not None:
        return cfg.eval.score
    return "correct" if cfg.data.task != "none" else next(iter(names), None)


def score_name(cfg: RunConfig) -> str:
    """What the run's held-out score is, for the lines a user reads."""
    n = cfg.eval.n_samples
    kind = "greedy" if n == 1 else f"sampled ({n} per problem)"
    if not PRESETS[cfg.algo.name].online and cfg.data.eval_file:
        return "pair accuracy (eval/pref_accuracy, the share of held-out pairs whose chosen " \
               "response gets the higher implicit reward)"
    term = score_term(cfg)
    if term == "correct":
        return f"{kind} accuracy"
    why = "eval.score" if cfg.eval.score else "the first of reward.functions; eval.score " \
                                              "chooses another"
    return f"{kind} eval/{term} ({why})"


def evaluate_policy(model: CausalLM, tokenizer: PreTrainedTokenizerBase,
                    problems: list[Problem], cfg: RunConfig, pool: SandboxPool | None = None,
                    tools: Tools | None = None, samples: list[dict] | None = None
                    ) -> dict[str, float]:
    """The held-out metrics: `eval.n_samples` responses per problem (greedy at the default
    `eval.temperature` 0; at most `eval.max_new_tokens`, ended by `rollout.stop`; with `tools`
    a conversation), scored by the run's own reward terms (the task's verifier and
    `reward.functions`; a reward model is left out). `eval_accuracy` is the share of
    responses with the verifier's full marks (where a verifier defines it); `eval/<term>`
    each term's mean and `eval/reward` their weighted sum's (unless it weighs the reward
    model); with n > 1, `eval/pass@k` (unbiased, k = 1, 2, 4, ..., n; a response passes with
    the score term's full marks) and `eval/mean@n`. `score` is the run's score (`score_term`):
    accuracy for the verifier's term, else the term's mean. Given `samples`, each problem's
    results are appended to it: its prompt, answer and source row, each response with its
    reward terms, how many passed, and with n > 1 its pass@k."""
    e, term = cfg.eval, score_term(cfg)
    params = SamplingParams(max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                            top_p=e.top_p, stop=tuple(cfg.rollout.stop))
    generator = torch.Generator(device=model_device(model)).manual_seed(cfg.seed + EVAL_SEED)
    rewarder = Rewarder(cfg, tokenizer, None, pool)
    sums: dict[str, float] = {}
    passed: list[int] = []  # per problem, its responses with the score term's full marks
    verified = 0  # responses with the verifier's full marks
    for start in range(0, len(problems), EVAL_BATCH):
        chunk = problems[start:start + EVAL_BATCH]
        prompts = encode(tokenizer, [p.prompt for p in chunk for _ in range(e.n_samples)])
        if tools is None and cfg.rollout.engine == "vllm":  # the run's own vLLM server
            rollout = vllm_engine(model, tokenizer, cfg).generate(
                prompts, params, tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
        elif tools is None:
            rollout = engine_generate(model, prompts, params, tokenizer.eos_token_id,
                                      tokenizer.pad_token_id, generator,
                                      decode=tokenizer.decode)
        else:
            rollout, _ = respond(model, tokenizer, prompts, params, cfg, generator, 1, tools)
        group_ids = torch.arange(len(chunk)).repeat_interleave(e.n_samples)
        terms = rewarder.terms(chunk, group_ids, rollout)
        weights = cfg.reward.weights
        if weights.keys() <= terms.keys():  # no reward model here: no total with its term
            terms["reward"] = sum(w * terms[k] for k, w in weights.items())
        for name, values in terms.items():
            sums[name] = sums.get(name, 0.0) + values.float().sum().item()
        passed += (terms[term] >= 1.0).view(len(chunk), e.n_samples).sum(dim=1).tolist()
        if samples is not None:
            samples += _per_problem(chunk, decode_responses(tokenizer, rollout), terms,
                                    passed[-len(chunk):], e.n_samples)
        if "correct" in terms:
            verified += int((terms["correct"] >= 1.0).sum())
    samples = len(problems) * e.n_samples
    out = {f"eval/{name}": total / samples for name, total in sums.items()}
    if "correct" in sums:
        out["eval_accuracy"] = verified / samples
    out["score"] = out["eval_accuracy"] if term == "correct" else out[f"eval/{term}"]
    if e.n_samples > 1:
        for k in ks(e.n_samples):
            out[f"eval/pass@{k}"] = sum(pass_at_k(e.n_samples, c, k) for c in passed) / len(passed)
        out[f"eval/mean@{e.n_samples}"] = sum(passed) / samples
    return out


def _per_problem(chunk: list[Problem], texts: list[str], terms: dict[str, torch.Tensor],
                 passed: list[int], n: int) -> list[dict]:
    out = []
    for i, p in enumerate(chunk):
        rows = slice(i * n, (i + 1) * n)
        out.append({"prompt": p.prompt, "answer": p.answer, "source": p.source,
                    "responses": [{"completion": texts[j],
                                   **{k: float(v[j]) for k, v in terms.items()}}
                                  for j in range(rows.start, rows.stop)],
                    "passed": passed[i],
                    **{f"pass@{k}": pass_at_k(n, passed[i], k) for k in ks(n) if n > 1}})
    return out


def evaluate_checkpoint(cfg: RunConfig) -> dict[str, object]:
    """`rlloom eval`: `model.path` scored on the run's held-out problems (`data.eval_file`, or
    the task's own) as `evaluate_policy` scores a training run's."""
    from rlloom.models.hf_io import DTYPES, load_model, load_tokenizer
    from rlloom.runtime.device import resolve_device
    problems = eval_problems(cfg)
    if not problems:
        raise DataError("no held-out problems: set data.eval_file to prompt rows (or "
                        "data.prompt_file, whose share data.eval_fraction is held out); a DPO "
                        "run's held-out pairs are scored during training (eval/pref_accuracy)")
    device = resolve_device(cfg.train.device)
    model = load_model(cfg.model.path, DTYPES[cfg.model.dtype]).to(device).eval()
    tokenizer = load_tokenizer(cfg.model.path, cfg.data.chat_template)
    pool = sandbox_pool(cfg.reward) if cfg.data.task == "code" else None
    samples: list[dict] = []
    try:
        scores = evaluate_policy(model, tokenizer, problems, cfg, pool,
                                 Tools.of(cfg.rollout, cfg.reward.sandbox_isolation), samples)
    finally:
        if pool is not None:
            pool.close()
    e = cfg.eval
    return {"checkpoint": cfg.model.path, "problems": len(problems), "n_samples": e.n_samples,
            "temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens,
            "score_name": score_name(cfg), **scores, "samples": samples}
