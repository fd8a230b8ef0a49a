"""TRL's (and verl's) config names, meaning what their users mean.

A TRL user writes `learning_rate=1e-6 beta=0.04 num_generations=8` or puts those keys at the top
of a YAML file. Each name in `NAMES` is either mapped onto rlloom's key (with the value
converted where the meaning differs: `warmup_ratio` is a share of the steps, `bf16` a compute
dtype) or refused with the rlloom way to say it, where rlloom has no such knob or decides it
otherwise. `beta` depends on the algorithm, as in TRL: the KL coefficient for GRPO-family
(online) presets, DPO's inverse temperature for offline ones. `algo.beta` is DPO's only: set
on an online preset it is refused, naming `algo.kl_coef` (a config.yaml of an older run, which
holds the default 0.1 there, still reads). docs/own-model.md, "TRL's names", lists the table.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# TRL/verl name -> rlloom key (value as given), or (rlloom key, conversion(value, steps))
MAPPED: dict[str, str | tuple[str, Callable[[Any, int], Any]]] = {
    "learning_rate": "train.lr",
    "num_generations": "rollout.n_samples",
    "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens",
    "epsilon": "algo.clip_low",
    "epsilon_high": "algo.clip_high",
    "max_grad_norm": "train.grad_clip",
    "lr_scheduler_type": ("train.lr_schedule", lambda v, _: _schedule(v)),
    "save_total_limit": "checkpoint.keep",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "min_p": "rollout.min_p",
    "repetition_penalty": "rollout.repetition_penalty",
    "reward_weights": "reward.weights",
    "report_to": "log.trackers",
    "output_dir": "run_dir",
    # verl's
    "kl_loss_coef": "algo.kl_coef",
    "ppo_epochs": "algo.epochs",
    "clip_ratio_high": "algo.clip_high",
    "response_length": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "n": "rollout.n_samples",
    "train_batch_size": "train.prompts_per_step",
    "reward_funcs": "reward.functions",
    "warmup_ratio": ("train.warmup_steps",
                     lambda v, steps: round(float(v) * steps)),
    "bf16": ("train.compute_dtype", lambda v, _: "bfloat16" if v else "params"),
    "scale_rewards": ("algo.advantage", lambda v, _: _scale_rewards(v)),
}

# TRL's step counts are optimizer steps (its global_step); one rlloom step makes
# algo.epochs x algo.minibatches of them, so each is divided by that (or refused)
OPTIMIZER_STEPS = {"max_steps": "train.steps", "save_steps": "checkpoint.every",
                   "eval_steps": "eval.every"}

REFUSED = {
    "gradient_accumulation_steps": "rlloom accumulates on its own: train.micro_batch_tokens "
                                   "bounds the padded tokens of one forward/backward and every "
                                   "mini-batch (algo.minibatches per epoch) is one optimizer step",
    "per_device_train_batch_size": "a step trains on train.prompts_per_step x rollout.n_samples "
                                   "rollouts (split across devices by the plan); "
                                   "train.micro_batch_tokens sizes one forward/backward",
    "logging_steps": "every step is logged (metrics.jsonl, the progress bar, log.trackers)",
    "loss_type": "set algo.loss_agg (token-mean: TRL's dapo/bnpo, seq-mean-token-mean: grpo, "
                 "seq-mean-token-sum-norm: dr_grpo) or choose the dr_grpo / dapo preset "
                 "(algo=dr_grpo)",
    "use_vllm": "set rollout.engine=vllm (docs/vllm.md)",
    "fp16": "rlloom computes in fp32 or bf16 (train.compute_dtype); fp16 is not supported",
    "delta": "rlloom has no two-sided clip of the ratio; algo.clip_high bounds it above",
}


# TRL/verl names that rlloom has under another name with another unit or shape: not mapped,
# but an unknown key of that name points to rlloom's
POINTERS = {
    "warmup_steps": "train.warmup_steps (counted in RL steps: one generation and its updates)",
    "weight_decay": "train.weight_decay",
    "entropy_coef": "algo.entropy_coef",
    "entropy_coeff": "algo.entropy_coef",
    "gradient_checkpointing": "the plan's activation checkpointing, per role: "
                              "plan.layouts.actor.activation_checkpointing=true",
    "num_train_epochs": "train.steps (RL steps; each samples train.prompts_per_step prompts)",
    "per_device_eval_batch_size": "eval.batch_size",
}


def _schedule(value: Any) -> str:
    # transformers' constant_with_warmup is rlloom's constant (which warms up over
    # train.warmup_steps); its constant never warms up: _trl_forms drops the warm-up
    return "constant" if value == "constant_with_warmup" else value


def _scale_rewards(value: Any) -> str:
    if value in (True, "group"):
        return "grpo"
    if value in (False, "none"):
        return "dr_grpo"
    raise ValueError(f"scale_rewards={value!r}: rlloom scales by the group's std (true, "
                     "'group': algo.advantage=grpo) or not at all (false, 'none': dr_grpo)")


def _set(data: dict[str, Any], key: str, value: Any, name: str) -> None:
    node = data
    *sections, last = key.split(".")
    for part in sections:
        node = node.setdefault(part, {})
        if isinstance(node, str):  # `algo: ppo`
            node = data[part] = {"name": node}
    if last in node and node[last] != value:
        raise ValueError(f"{name}={value!r} is TRL's name for {key}, which is also set to "
                         f"{node[last]!r}; give one")
    node[last] = value


def translate(data: dict[str, Any], online: Callable[[str], bool], dpo_beta: float,
              defaults: dict[str, int]) -> dict[str, Any]:
    """`data` (a config as a nested dict) with TRL's top-level names moved to rlloom's keys;
    ValueError for a refused name. `online(preset)` says whether a preset samples;
    `dpo_beta` is algo.beta's default and `defaults` rlloom's defaults of the keys TRL's
    names reach ("train.steps", "algo.epochs", ...). A config that uses TRL's names is told
    once which of rlloom's defaults it leaves differ from TRL's GRPOConfig's."""
    data = dict(data)
    refused = [k for k in data if k in REFUSED]
    if refused:  # all of them at once: a port meets them together
        raise ValueError("; ".join(f"{name!r} is TRL's: {REFUSED[name]}" for name in refused))
    algo = data.get("algo")
    preset = algo if isinstance(algo, str) else (algo or {}).get("name", "grpo")
    if "beta" in data:
        beta = data.pop("beta")
        _set(data, "algo.kl_coef" if online(preset) else "algo.beta", beta, "beta")
    if isinstance(algo, dict) and online(preset) and algo.get("beta", dpo_beta) != dpo_beta:
        raise ValueError(f"algo.beta is DPO's inverse temperature and does nothing for "
                         f"algo={preset}; the KL coefficient (TRL's GRPO beta) is "
                         "algo.kl_coef, or write beta=... at the top level")
    # plain names first, then TRL's step counts, then conversions (warmup_ratio reads the
    # steps)
    trl = any(k in data for k in (*MAPPED, *OPTIMIZER_STEPS, "num_iterations", "beta"))
    names = sorted((k for k in data if k in MAPPED), key=lambda k: isinstance(MAPPED[k], tuple))
    data_names = {k: data[k] for k in names}
    plain = [k for k in names if not isinstance(MAPPED[k], tuple)]
    for name in plain:
        _set(data, MAPPED[name], data.pop(name), name)
    _optimizer_steps(data, defaults)
    for name in names[len(plain):]:
        target, convert = MAPPED[name]
        train = data.get("train") if isinstance(data.get("train"), dict) else {}
        _set(data, target, convert(data.pop(name),
                                    int(train.get("steps", defaults["train.steps"]))), name)
    if data_names.get("lr_scheduler_type") == "constant" and "warmup_ratio" in data_names:
        data["train"]["warmup_steps"] = 0  # transformers' constant schedule has no warm-up
    _trl_forms(data)
    if trl:
        _say_differing_defaults(data, defaults)
    return data


# TRL's GRPOConfig defaults (trl/trainer/grpo_config.py, transformers' TrainingArguments)
# where rlloom's differ, by rlloom key: (TRL's name, TRL's value)
TRL_DEFAULTS = {
    "train.lr": ("learning_rate", 1e-6),
    "algo.kl_coef": ("beta", 0.0),
    "rollout.max_new_tokens": ("max_completion_length", 256),
    "algo.loss_agg": ("loss_type", "dapo (token-mean)"),
    "train.lr_schedule": ("lr_scheduler_type", "linear"),
    "algo.minibatches": ("num_iterations", "1 update per generation"),
}
_said: set[str] = set()


def _say_differing_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> None:
    """One line (once per process) naming rlloom's defaults that a config written with TRL's
    names leaves in place where TRL's differ."""
    left = []
    for key, (name, trl_value) in TRL_DEFAULTS.items():
        section, field = key.split(".")
        node = data.get(section) if isinstance(data.get(section), dict) else {}
        if field in node or key == "algo.minibatches" and "epochs" in node:
            continue
        ours = (f"{defaults['algo.epochs']} x {defaults[key]} updates per generation"
                if key == "algo.minibatches" else defaults[key])
        left.append(f"{key}={ours} (TRL's {name}: {trl_value})")
    line = "rlloom's defaults differ from TRL's where this config sets nothing: " + \
        "; ".join(left)
    if left and line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


def _optimizer_steps(data: dict[str, Any], defaults: dict[str, int]) -> None:
    """TRL's `num_iterations` (passes over a generation, one accumulated update each) and its
    step counts, which count optimizer steps, in rlloom's units."""
    if "num_iterations" in data:
        _set(data, "algo.epochs", data.pop("num_iterations"), "num_iterations")
        algo = data["algo"]
        algo.setdefault("minibatches", 1)  # TRL: one optimizer step per pass
    given = [k for k in OPTIMIZER_STEPS if k in data]
    if not given:
        return
    algo = data.get("algo") if isinstance(data.get("algo"), dict) else {}
    epochs = int(algo.get("epochs", defaults["algo.epochs"]))
    minibatches = int(algo.get("minibatches", defaults["algo.minibatches"]))
    per_step = epochs * minibatches
    for name in given:
        value = data.pop(name)
        if not isinstance(value, int) or value % per_step:
            raise ValueError(
                f"{name}={value!r} counts optimizer steps (TRL's global_step); one rlloom "
                f"step makes algo.epochs x algo.minibatches = {epochs} x {minibatches} = "
                f"{per_step} of them, which does not divide it: give a multiple of {per_step}, "
                f"or rlloom's {OPTIMIZER_STEPS[name]} (in rlloom steps: one generation and its "
                "updates)")
        _set(data, OPTIMIZER_STEPS[name], value // per_step, name)


def _trl_forms(data: dict[str, Any]) -> None:
    """TRL's shapes of two values: `reward_weights` as a list, one per reward function in
    order, and `report_to` as a string or "none"."""
    reward = data.get("reward") if isinstance(data.get("reward"), dict) else {}
    weights = reward.get("weights")
    if isinstance(weights, list):
        names = [str(spec).rpartition(":")[2] for spec in reward.get("functions") or []]
        if len(names) != len(weights):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(names)} "
                             "reward functions; give one per function, in their order")
        reward["weights"] = dict(zip(names, weights))
    log = data.get("log") if isinstance(data.get("log"), dict) else {}
    trackers = log.get("trackers")
    if isinstance(trackers, str):
        log["trackers"] = [] if trackers == "none" else [trackers]


def rlloom_key(name: str) -> str | None:
    """rlloom's key for a TRL/verl name (for hints on a nested key), if it has one."""
    target = MAPPED.get(name, OPTIMIZER_STEPS.get(name))
    if name == "num_iterations":
        return "algo.epochs"
    return target[0] if isinstance(target, tuple) else target
