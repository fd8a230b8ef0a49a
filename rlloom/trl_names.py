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

import math
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
    # transformers' share of the steps, rounded up (TrainingArguments.get_warmup_steps)
    "warmup_ratio": ("train.warmup_steps", lambda v, steps: _share(v, steps)),
    "bf16": ("train.compute_dtype", lambda v, _: "bfloat16" if v else "params"),
    "scale_rewards": ("algo.advantage", lambda v, _: _scale_rewards(v)),
    "loss_type": ("algo.loss_agg", lambda v, _: _loss_type(v)),
}

# TRL's step counts are optimizer steps (its global_step); one rlloom step makes
# algo.epochs x algo.minibatches of them, so each is divided by that (or refused)
OPTIMIZER_STEPS = {"max_steps": "train.steps", "save_steps": "checkpoint.every",
                   "eval_steps": "eval.every", "warmup_steps": "train.warmup_steps"}

REFUSED = {
    "gradient_accumulation_steps": "rlloom accumulates on its own: train.micro_batch_tokens "
                                   "bounds the padded tokens of one forward/backward and every "
                                   "mini-batch (algo.minibatches per epoch) is one optimizer step",
    "per_device_train_batch_size": "a step trains on train.prompts_per_step x rollout.n_samples "
                                   "rollouts (split across devices by the plan); "
                                   "train.micro_batch_tokens sizes one forward/backward",
    "logging_steps": "every step is logged (metrics.jsonl, the progress bar, log.trackers)",
    "use_vllm": "set rollout.engine=vllm (docs/vllm.md)",
    "fp16": "rlloom computes in fp32 or bf16 (train.compute_dtype); fp16 is not supported",
    "delta": "rlloom has no two-sided clip of the ratio; algo.clip_high bounds it above",
}


# TRL/verl names that rlloom has under another name with another unit or shape: not mapped,
# but an unknown key of that name points to rlloom's
POINTERS = {
    "weight_decay": "train.weight_decay",
    "entropy_coef": "algo.entropy_coef",
    "entropy_coeff": "algo.entropy_coef",
    "gradient_checkpointing": "the plan's activation checkpointing, per role: "
                              "plan.layouts.actor.activation_checkpointing=true",
    "activation_checkpointing": "the plan's, per role: "
                                "plan.layouts.actor.activation_checkpointing=true",
    "num_train_epochs": "train.steps (RL steps; each samples train.prompts_per_step prompts)",
    "per_device_eval_batch_size": "eval.batch_size",
}


def _share(value: Any, steps: int) -> int:
    return math.ceil(float(value) * steps)


def _schedule(value: Any) -> str:
    # transformers' constant_with_warmup is rlloom's constant (which warms up over
    # train.warmup_steps); its constant never warms up: _trl_forms drops the warm-up
    return "constant" if value == "constant_with_warmup" else value


# TRL's loss_type -> rlloom's algo.loss_agg, where the two normalise alike
LOSS_TYPES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}


def _loss_type(value: Any) -> str:
    if value in LOSS_TYPES:
        return LOSS_TYPES[value]
    other = {"bnpo": "it normalises by one device's tokens; the nearest is dapo (algo.loss_agg="
                     "token-mean, over the whole batch's tokens)",
             "cispo": "choose rlloom's cispo preset (algo=cispo)"}
    raise ValueError(f"loss_type={value!r}: " + other.get(
        value, "rlloom has no such loss; it takes " + ", ".join(
            f"{k} (algo.loss_agg={v})" for k, v in LOSS_TYPES.items())))


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


def translate(data: dict[str, Any], preset_of: Callable[[str], tuple[bool, dict[str, Any]]],
              dpo_beta: float, defaults: dict[str, Any]) -> dict[str, Any]:
    """`data` (a config as a nested dict) with TRL's top-level names moved to rlloom's keys;
    ValueError for a refused name. `preset_of(name)` says whether a preset samples and
    which algo defaults it changes;
    `dpo_beta` is algo.beta's default and `defaults` rlloom's defaults of the keys TRL's
    names reach ("train.steps", "algo.epochs", ...). A config that uses TRL's names is told
    once which of rlloom's defaults it leaves differ from TRL's GRPOConfig's."""
    data = dict(data)
    refused = [k for k in data if k in REFUSED]
    if refused:  # all of them at once: a port meets them together
        raise ValueError("; ".join(f"{name!r} is TRL's: {REFUSED[name]}" for name in refused))
    algo = data.get("algo")
    preset = algo if isinstance(algo, str) else (algo or {}).get("name", "grpo")
    online, changes = preset_of(preset)
    defaults = {**defaults, **{f"algo.{k}": v for k, v in changes.items()}}
    if "beta" in data:
        beta = data.pop("beta")
        _set(data, "algo.kl_coef" if online else "algo.beta", beta, "beta")
    if isinstance(algo, dict) and online and algo.get("beta", dpo_beta) != dpo_beta:
        raise ValueError(f"algo.beta is DPO's inverse temperature and does nothing for "
                         f"algo={preset}; the KL coefficient (TRL's GRPO beta) is "
                         "algo.kl_coef, or write beta=... at the top level")
    # plain names first, then the generation's shape, then TRL's step counts, then
    # conversions (warmup_ratio reads the steps)
    trl = any(k in data for k in (*MAPPED, *OPTIMIZER_STEPS, *GENERATION, "num_iterations",
                                  "beta"))
    names = sorted((k for k in data if k in MAPPED), key=lambda k: isinstance(MAPPED[k], tuple))
    data_names = {k: data[k] for k in names}
    warmup_given = "warmup_ratio" in data or "warmup_steps" in data
    if "epsilon" in names and "epsilon_high" not in data and \
            "clip_high" not in _section(data, "algo"):
        _set(data, "algo.clip_high", data["epsilon"], "epsilon")  # TRL: epsilon_high=epsilon
    plain = [k for k in names if not isinstance(MAPPED[k], tuple)]
    for name in plain:
        _set(data, MAPPED[name], data.pop(name), name)
    _generation(data, defaults)
    _optimizer_steps(data, defaults)
    for name in names[len(plain):]:
        target, convert = MAPPED[name]
        _set(data, target, convert(data.pop(name), _steps(data, defaults)), name)
    if data_names.get("lr_scheduler_type") == "constant" and warmup_given:
        data["train"]["warmup_steps"] = 0  # transformers' constant schedule has no warm-up
    _trl_forms(data)
    if trl and online:  # TRL_DEFAULTS are GRPOConfig's
        _say_differing_defaults(data, defaults)
    return data


def _section(data: dict[str, Any], name: str) -> dict[str, Any]:
    node = data.get(name)
    return node if isinstance(node, dict) else {}


def _steps(data: dict[str, Any], defaults: dict[str, Any]) -> int:
    return int(_section(data, "train").get("steps", defaults["train.steps"]))


# TRL's GRPOConfig defaults (trl/trainer/grpo_config.py, transformers' TrainingArguments)
# where rlloom's differ, by rlloom key: (TRL's name, TRL's value, rlloom's value for it;
# algo.minibatches' is the updates per generation, algo.epochs x algo.minibatches)
TRL_DEFAULTS = {
    "train.lr": ("learning_rate", 1e-6, 1e-6),
    "algo.kl_coef": ("beta", 0.0, 0.0),
    "rollout.max_new_tokens": ("max_completion_length", 512, 512),
    "algo.loss_agg": ("loss_type", "dapo (token-mean)", "token-mean"),
    "train.lr_schedule": ("lr_scheduler_type", "linear", "linear"),
    "algo.minibatches": ("num_iterations", "1 update per generation", 1),
    "train.prompts_per_step": ("generation_batch_size",
                               "8 completions per device: 1 prompt of num_generations=8", 1),
}
_said: set[str] = set()


def differing_defaults(values: dict[str, Any]) -> list[str]:
    """`key=value (TRL's name: its default)` for each of TRL_DEFAULTS' keys whose value in
    `values` (with "algo.epochs", for the updates per generation) is not TRL's default."""
    lines = []
    for key, (name, trl_value, same) in TRL_DEFAULTS.items():
        ours = values[key]
        if key == "algo.minibatches":
            ours, shown = (values["algo.epochs"] * ours,
                           f"{values['algo.epochs']} x {ours} updates per generation")
        else:
            shown = ours
        if ours != same:
            lines.append(f"{key}={shown} (TRL's {name}: {trl_value})")
    return lines


def _say_differing_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> None:
    """One line (once per process) naming rlloom's defaults that a config written with TRL's
    names leaves in place where TRL's differ."""
    def given(key: str) -> bool:
        section, field = key.split(".")
        node = _section(data, section)
        return field in node or key == "algo.minibatches" and "epochs" in node
    values = dict(defaults)
    for key in filter(given, TRL_DEFAULTS):  # set by the config: no default left in place
        values[key] = TRL_DEFAULTS[key][2]
        if key == "algo.minibatches":
            values["algo.epochs"] = 1
    left = differing_defaults(values)
    line = "rlloom's defaults differ from TRL's where this config sets nothing: " + \
        "; ".join(left)
    if left and line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


# TRL's shape of one generation (GRPOConfig, with gradient_accumulation_steps=1)
GENERATION = {"steps_per_generation": "algo.minibatches",
              "generation_batch_size": "train.prompts_per_step"}


def _generation(data: dict[str, Any], defaults: dict[str, Any]) -> None:
    """TRL's `steps_per_generation` (optimizer steps one generation makes in each pass) is
    algo.minibatches, with TRL's one pass unless num_iterations says otherwise; its `generation_batch_size` (completions per generation) is
    train.prompts_per_step groups of rollout.n_samples."""
    if "steps_per_generation" in data:
        _set(data, GENERATION["steps_per_generation"], data.pop("steps_per_generation"),
             "steps_per_generation")
        if "num_iterations" not in data:
            data["algo"].setdefault("epochs", 1)  # TRL's num_iterations default: one pass
    if "generation_batch_size" in data:
        size = data.pop("generation_batch_size")
        k = int(_section(data, "rollout").get("n_samples", defaults["rollout.n_samples"]))
        if not isinstance(size, int) or size % k:
            raise ValueError(f"generation_batch_size={size!r} counts completions; rlloom "
                             f"generates train.prompts_per_step groups of rollout.n_samples="
                             f"{k}, which does not divide it: give a multiple of {k}, or "
                             "train.prompts_per_step")
        _set(data, GENERATION["generation_batch_size"], size // k, "generation_batch_size")


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
    algo = _section(data, "algo")
    epochs = int(algo.get("epochs", defaults["algo.epochs"]))
    minibatches = int(algo.get("minibatches", defaults["algo.minibatches"]))
    per_step = epochs * minibatches
    for name in given:  # max_steps first: a warm-up's share reads it
        value = data.pop(name)
        if name == "warmup_steps" and isinstance(value, float) and 0 < value < 1:
            # transformers: a float below 1 is a share of the steps
            _set(data, OPTIMIZER_STEPS[name], _share(value, _steps(data, defaults)), name)
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
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
    target = MAPPED.get(name, OPTIMIZER_STEPS.get(name, GENERATION.get(name)))
    if name == "num_iterations":
        return "algo.epochs"
    return target[0] if isinstance(target, tuple) else target
