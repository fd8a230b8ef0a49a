"""The typed run configuration: YAML file + dotted command-line overrides, one source of defaults.

Every field has a one-line description; unknown keys and wrong types are `ConfigError`s that
name the key and suggest the closest valid one.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

import rlloom.trl_names as trl_names
from rlloom.config_errors import ConfigError, explain
from rlloom.algos.presets import PRESETS
from rlloom.config_sections import (
    DataSection,
    EvalSection,
    FilePath,
    ModelSection,
    RolloutSection,
)
from rlloom.plan import Plan, Strict, engine_problems
from rlloom.rewards import functions as reward_functions
from rlloom.rollout.vllm_env import config_problems as vllm_problems
from rlloom.runtime.outputs.trackers import check_installed
from rlloom.user_code import function_name


# Advantage estimators that compare the K samples of one prompt.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


class AlgoSection(Strict):
    """The algorithm: a preset name plus any field to change. Fields not given take the
    preset's value (rlloom.algos.presets), else the base default below."""
    name: Literal[tuple(PRESETS)] = Field("grpo", description="algorithm preset "
                                          "(`rlloom algos` lists them)")
    advantage: str = Field("grpo", description="advantage estimator (registry name)")
    policy_loss: str = Field("ppo", description="policy loss (registry name)")
    loss_agg: str = Field("seq-mean-token-mean", description="how token losses become one "
                          "number (registry name)")
    clip_low: float = Field(0.2, ge=0, le=1, description="ratio clip below 1")
    clip_high: float = Field(0.2, ge=0, description="ratio clip above 1 (DAPO clip-higher)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip bound c for negative "
                                    "advantages; null = off")
    cispo_clip_high: float = Field(3.0, ge=0, description="cispo: cap of the detached "
                                   "importance weight is 1 + this (no floor)")
    kl_coef: float = Field(0.001, ge=0, description="weight of the KL to the reference")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator")
    kl_in_reward: bool = Field(False, description="KL as a per-token reward penalty (classic "
                               "PPO) instead of a loss term")
    kl_target: float | None = Field(None, gt=0, description="adaptive KL: target per-token KL; "
                                    "null = fixed kl_coef")
    kl_horizon: int = Field(10000, ge=1, description="adaptive KL: horizon in samples")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus weight")
    rollout_is: Literal["none", "token_tis", "seq_tis"] = Field(
        "none", description="sampler/trainer mismatch correction (algos/rollout_correction.py):"
        " the trainer recomputes the behaviour log-probs (always with rollout.engine=vllm, "
        "logging mismatch_k1 and mismatch_max_ratio) and weights each token (token_tis) or "
        "sequence (seq_tis) by min(pi_trainer / pi_sampler, rollout_is_cap); none: no weights")
    rollout_is_cap: float = Field(2.0, gt=0, description="truncation of the rollout_is weights "
                                  "(verl's rollout_is_threshold)")
    epochs: int = Field(2, ge=1, description="optimisation passes over each step's rollouts")
    minibatches: int = Field(2, ge=1, description="optimizer steps per epoch")
    gamma: float = Field(1.0, ge=0, le=1, description="discount (gae, reinforce_pp)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (1: every token gets the "
                       "full return minus its value; below 1 starves early tokens of long "
                       "responses until the critic is good)")
    vf_coef: float = Field(0.5, ge=0, description="value-loss weight (ppo)")
    value_clip: float | None = Field(0.2, gt=0, description="value clip around old values; "
                                     "null = off")
    critic_lr: float = Field(1e-4, gt=0, description="critic learning rate (separate critic)")
    dynamic_sampling: bool = Field(False, description="drop groups whose rewards are all equal "
                                   "and generate more (DAPO)")
    max_sample_rounds: int = Field(3, ge=1, description="dynamic sampling: generation rounds "
                                   "per step at most")
    overlong: Literal["none", "filter", "penalty"] = Field(
        "none", description="truncated responses: keep, drop from the loss, or soft penalty")
    overlong_cache: int = Field(16, ge=1, description="soft overlong penalty ramp, in tokens")
    beta: float = Field(0.1, gt=0, description="DPO inverse temperature")
    preference_loss: Literal["dpo", "ipo"] = Field("dpo", description="offline preference loss")
    routing_replay: Literal["none", "replay"] = Field(
        "none", description="MoE: replay in training the experts each token was routed to "
        "while generated (R3), so the ratio compares one network; logs routing_agreement")

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"name": data}
        if isinstance(data, dict) and data.get("name", "grpo") in PRESETS:
            return {**PRESETS[data.get("name", "grpo")].overrides, **data}
        return data


REWARD_TERMS = ("correct", "format", "model")


class RewardSection(Strict):
    """The reward is a weighted sum of terms, each logged as reward/<term>."""
    weights: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0},
        description="term -> weight; terms: correct (verifier: 1/0, or the fraction of unit "
                    "tests passed), format (well-formed final answer), model (reward model), "
                    "and each reward function by its name (default: 1 for each function "
                    "when reward.functions is set and the weights are not)")
    functions: list[str] = Field([], description="Python reward functions, TRL's signature "
                                 "f(prompts, completions, completion_ids, **columns) -> list "
                                 "of floats, as module.path:function or file.py:function")
    model_path: FilePath = Field(None, description="reward model checkpoint (a *ForSequence"
                                   "Classification with one label, same tokenizer as the policy)")
    timeout_s: float = Field(300.0, gt=0, description="seconds a reward function may take on "
                             "a batch; past it the run stops naming the function")
    retries: int = Field(2, ge=0, description="times a reward function call that raises is "
                         "retried (after 0.5 s, then 1 s, ...) before the samples are tried one "
                         "by one to name the one it fails on")
    sandbox_workers: int = Field(2, ge=1, description="parallel programs for the code task")
    sandbox_isolation: Literal["strict", "namespaces", "process"] = Field(
        "strict", description="what each program of the code task and the python tool runs "
        "in (docs/sandbox.md): strict (own namespaces, root, uid and a cgroup for its memory "
        "and processes; refused where the machine cannot), namespaces (the same without the "
        "cgroup: memory and processes bounded per process and per uid), process (rlimits "
        "only; for trusted programs)")
    code_score: Literal["all", "fraction"] = Field(
        "all", description="the code task's `correct` term: all (1 when every test passes, "
        "else 0; DeepCoder's and most code-RL recipes' choice) or fraction (the share of "
        "tests passed: partial solutions, and programs that hard-code the cases they can "
        "guess, earn reward)")
    code_compare: Literal["exact", "tokens", "float"] = Field(
        "tokens", description="how stdin/stdout tests compare a program's output with the "
        "expected one: exact (line by line, trailing whitespace ignored), tokens "
        "(whitespace-separated tokens), float (tokens, numbers within code_float_tol where "
        "either is not an integer; integers exactly)")
    code_float_tol: float = Field(1e-6, gt=0,
                                  description="absolute or relative tolerance of "
                                  "code_compare=float")

    @model_validator(mode="before")
    @classmethod
    def _function_weights(cls, data: Any) -> Any:
        """Functions given without weights: each weighs 1 (TRL's default), nothing else."""
        if isinstance(data, dict) and data.get("functions") and "weights" not in data:
            data = {**data, "weights": {function_name(str(s)): 1.0
                                        for s in data["functions"]}}
        return data

    @field_validator("functions")
    @classmethod
    def _resolve(cls, specs: list[str]) -> list[str]:
        return [reward_functions.resolve_spec(s, Path.cwd()) for s in specs]

    @model_validator(mode="after")
    def _known_terms(self) -> "RewardSection":
        # fails early, naming the function
        names = [reward_functions.load(s)[0] for s in self.functions]
        twice = {n for n in names if names.count(n) > 1}
        if twice:
            raise ValueError(f"reward.functions: {sorted(twice)} named twice; rename one")
        # the verifier's terms are the only source of "accuracy": a user's function never
        # becomes it by its name (TRL users often call theirs `correct`)
        clash = sorted({"correct", "format"} & set(names))
        if clash:
            raise ValueError(f"reward.functions: {clash} named like the task verifier's terms "
                             "(correct gives the run's accuracy); rename the function: it is "
                             "logged as reward/<name>, and eval.score=<name> makes it the "
                             "run's score")
        if "model" in names and self.model_path:
            raise ValueError("reward.functions: a function named 'model' and reward.model_path "
                             "would both be the term 'model'; rename the function")
        unknown = set(self.weights) - set(REWARD_TERMS) - set(names)
        if unknown:
            raise ValueError(f"reward.weights has unknown terms {sorted(unknown)}; terms are "
                             f"{', '.join((*REWARD_TERMS, *names))}")
        if "model" in self.weights and not self.model_path:
            raise ValueError("reward.weights.model needs reward.model_path (a reward model)")
        return self


class TrainSection(Strict):
    steps: int = Field(40, ge=1, description="RL steps (each: generate, assess, train)")
    prompts_per_step: int = Field(32, ge=1, description="prompts per step (B)")
    lr: float = Field(5e-5, gt=0, le=1,
                      description="AdamW learning rate (the peak, with a schedule); at most 1: "
                      "above it AdamW's steps of about lr per weight wreck any model")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a step whose reward, advantage, loss or gradient norm is NaN or "
        "infinite is never applied: stop ends the run naming the step, the quantity and the "
        "likely cause (exit code 3; no checkpoint is written from it); skip drops that "
        "update, counts it as nonfinite_skips in the metrics and goes on")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="learning rate over the RL steps after the warm-up: constant, "
        "or a linear or cosine decay towards lr x min_lr_ratio, reached one step after the "
        "last as in transformers (algo.critic_lr follows the same schedule)")
    warmup_steps: int = Field(0, ge=0, description="RL steps of linear warm-up from lr / "
                              "warmup_steps to lr")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's final learning rate "
                                "as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="max gradient norm")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = all cores")
    micro_batch_tokens: int = Field(8192, ge=1, description="padded tokens per forward/"
                                    "backward micro-batch (bounds activation memory); rows of "
                                    "similar length share one. Under torchrun every rank runs "
                                    "as many as the rank that needs the most")
    device: str = Field("auto", description="where models and tensors live: auto (cuda when "
                        "torch.cuda.is_available(), else cpu), cpu, cuda or cuda:N; under "
                        "torchrun cuda means cuda:LOCAL_RANK")
    compute_dtype: Literal["auto", "params", "bfloat16"] = Field(
        "auto", description="dtype of the matmuls in every stage: params (model.dtype), or "
        "bfloat16 under autocast with the weights and optimizer state kept in model.dtype "
        "(fp32 masters); auto = bfloat16 on GPUs that support it, params elsewhere")

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        # only the spelling here: whether this machine has the device is the runtime's check
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("use auto, cpu, cuda or cuda:N")
        return v


class CheckpointSection(Strict):
    every: int = Field(10, ge=1, description="save a resumable checkpoint every N steps")
    keep: int = Field(1, ge=1, description="how many recent checkpoints to keep")


class SFTSection(Strict):
    steps: int = Field(900, ge=1, description="supervised warm-start steps")
    batch_size: int = Field(64, ge=1, description="sequences per SFT step")
    lr: float = Field(2e-3, gt=0, description="SFT AdamW learning rate")
    direct_fraction: float = Field(0.55, ge=0, le=1, description="share of the built-in "
                                   "tasks' SFT targets cut to the bare answer line (no worked "
                                   "steps); a prompt file's solutions are trained as written")


class LogSection(Strict):
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        [], description="experiment trackers fed every step's metrics and the config (each an "
        "extra: pip install 'rlloom[tensorboard]'); tensorboard writes run_dir/tensorboard, "
        "mlflow a file store in run_dir/mlruns unless MLFLOW_TRACKING_URI is set, wandb "
        "follows WANDB_MODE (offline, online)")
    project: str = Field("rlloom", description="W&B project / MLflow experiment name")

    @field_validator("trackers")
    @classmethod
    def _installed(cls, names: list[str]) -> list[str]:
        check_installed(names)
        return names


_SECTIONS = {"train": TrainSection, "algo": AlgoSection, "rollout": RolloutSection}
# rlloom's defaults of the keys TRL's names reach (trl_names.translate)
_DEFAULTS = {f"{name}.{key}": cls.model_fields[key].default for name, cls in _SECTIONS.items()
             for key in ("steps", "lr", "lr_schedule", "epochs", "minibatches", "kl_coef",
                         "loss_agg", "max_new_tokens", "n_samples", "prompts_per_step")
             if key in cls.model_fields}


class RunConfig(Strict):
    seed: int = Field(0, description="seed of data, initialisation and sampling")
    run_dir: str | None = Field(None, description="output directory; null = runs/<time>")
    model: ModelSection = Field(default_factory=ModelSection, description="policy model")
    data: DataSection = Field(default_factory=DataSection, description="prompts and task")
    rollout: RolloutSection = Field(default_factory=RolloutSection, description="generation")
    algo: AlgoSection = Field(default_factory=AlgoSection, description="RL algorithm")
    reward: RewardSection = Field(default_factory=RewardSection, description="reward terms")
    train: TrainSection = Field(default_factory=TrainSection, description="optimisation")
    eval: EvalSection = Field(default_factory=EvalSection, description="held-out evaluation")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection,
                                          description="checkpointing")
    sft: SFTSection = Field(default_factory=SFTSection, description="supervised warm start")
    plan: Plan = Field(default_factory=Plan, description="placement, layouts and schedule")
    log: LogSection = Field(default_factory=LogSection, description="experiment trackers")

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, data: Any) -> Any:
        """TRL's and verl's top-level names, mapped or refused (rlloom/trl_names.py); then
        evaluation decodes as long as training samples unless told otherwise (after the
        translation, so that TRL's max_completion_length reaches it too)."""
        if not isinstance(data, dict):
            return data
        data = trl_names.translate(data, lambda p: (PRESETS[p].online, PRESETS[p].overrides)
                                   if p in PRESETS else (True, {}),
                                   AlgoSection.model_fields["beta"].default, _DEFAULTS)
        rollout, evaluation = data.get("rollout") or {}, data.get("eval") or {}
        if (isinstance(rollout, dict) and isinstance(evaluation, dict)
                and "max_new_tokens" in rollout and "max_new_tokens" not in evaluation):
            data = {**data, "eval": {**evaluation, "max_new_tokens": rollout["max_new_tokens"]}}
        return data

    @property
    def lora_rank(self) -> int:
        """The LoRA adapters' rank, 0 when every weight trains (the cost model's knob)."""
        return self.model.lora.rank if self.model.lora is not None else 0

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model exists for a KL term, or to score DPO's pairs."""
        a = self.algo
        return a.kl_coef > 0 or a.kl_target is not None or not PRESETS[a.name].online

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "RunConfig":
        grouped = self.algo.advantage in GROUP_ESTIMATORS
        if grouped and self.rollout.n_samples < 2:
            raise ValueError(f"rollout.n_samples={self.rollout.n_samples}: algo.advantage="
                             f"{self.algo.advantage} compares samples of the same prompt; set "
                             "rollout.n_samples>=2")
        if grouped and self.rollout.temperature == 0:
            raise ValueError("rollout.temperature=0 makes every sample of a group identical, so "
                             "group advantages are all zero; set rollout.temperature>0")
        if self.data.task == "math" and not (self.data.prompt_file and self.model.path):
            raise ValueError("data.task=math has no built-in problems or model; set "
                             "data.prompt_file (a jsonl of prompt/answer rows) and model.path")
        problems = task_problems(self, rewarded=not (info.context or {}).get("sft"))
        if problems:
            raise ValueError("; ".join(problems))
        if self.plan.adapt.every and not PRESETS[self.algo.name].online:
            raise ValueError(f"plan.adapt re-prices generation, assessment and training; "
                             f"algo={self.algo.name} trains offline: set plan.adapt.every=0")
        if self.plan.adapt.every and self.reward.model_path:
            raise ValueError("plan.adapt does not price runs with a reward model yet: set "
                             "plan.adapt.every=0 or drop reward.model_path")
        if not PRESETS[self.algo.name].online and not self.data.preference_file:
            raise ValueError(f"algo={self.algo.name} trains offline on preference pairs; set "
                             "data.preference_file to a jsonl of prompt/chosen/rejected rows")
        if self.model.critic_path and ("critic" not in PRESETS[self.algo.name].roles
                                       or self.plan.actor_critic == "shared"):
            raise ValueError(f"model.critic_path is set but algo={self.algo.name} with "
                             f"plan.actor_critic={self.plan.actor_critic} has no separate "
                             "critic to start from it; use algo=ppo with "
                             "plan.actor_critic=separate, or drop model.critic_path")
        r = self.rollout
        if r.engine == "vllm":
            problems = vllm_problems(r.temperature, r.top_p, r.top_k, r.min_p,
                                     r.repetition_penalty)
            if r.tools or r.partial_tokens:
                problems.append("rollout.engine=vllm does not run multi-turn tool rollouts "
                                "or partial rollouts yet; use rollout.engine=rlloom for "
                                "rollout.tools / rollout.partial_tokens")
            problems += engine_problems(r.engine, self.plan)
            if problems:
                raise ValueError("; ".join(problems))
        batch = self.train.prompts_per_step * self.rollout.n_samples
        if batch % self.algo.minibatches:
            raise ValueError(f"algo.minibatches={self.algo.minibatches} must divide the "
                             f"{batch} rollouts per step (train.prompts_per_step x "
                             "rollout.n_samples)")
        return self


def task_problems(cfg: RunConfig, rewarded: bool = True) -> list[str]:
    """What `data.task` and `eval.score` leave unscored: without a verifier (task none) only
    the user's functions or reward model give a reward (not needed when nothing is
    `rewarded`: `rlloom sft`), and the score must be a term the held-out evaluation computes
    (a reward model's is not)."""
    d, r = cfg.data, cfg.reward
    names = [function_name(s) for s in r.functions]
    problems = []
    if d.task == "none":
        if not ((d.prompt_file or d.eval_file) and cfg.model.path):
            problems.append("data.task=none has no built-in problems or model; set "
                            "data.prompt_file (or for rlloom eval data.eval_file) and "
                            "model.path")
        if rewarded and not (names or r.model_path):
            problems.append("data.task=none has no verifier, so nothing rewards a response; "
                            "set reward.functions (or reward.model_path)")
        idle = sorted(set(r.weights) & {"correct", "format"} - set(names))
        if idle and (names or r.model_path):
            problems.append(f"data.task=none has no verifier, so reward.weights' {idle} "
                            f"score nothing; weigh {names + (['model'] if r.model_path else [])}")
    scored = names + ([] if d.task == "none" else ["correct", "format"])
    if cfg.eval.score is not None and cfg.eval.score not in scored:
        problems.append(f"eval.score={cfg.eval.score!r} is not a term the evaluation scores; "
                        f"choose one of {sorted(set(scored))} (a reward model is not scored "
                        "on held-out prompts)")
    return problems


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got "
                          f"{type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dict `data`; the value is parsed as YAML (so 3, 0.1, true)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if isinstance(child, str):  # `algo=ppo algo.kl_coef=0.1`: a bare string is the name
            child = node[part] = {"name": child}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        node[parts[-1]] = raw


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                sft: bool = False) -> RunConfig:
    """Defaults, then the YAML file, then each `key=value` override (`sft`: for a warm start,
    which rewards nothing)."""
    data = _read_yaml(Path(path)) if path else {}
    for item in overrides:
        apply_override(data, item)
    source = " + ".join(([str(path)] if path else ["defaults"]) +
                        ([f"overrides {list(overrides)}"] if overrides else []))
    return validate_config(data, source, sft)


def validate_config(data: dict[str, Any], source: str, sft: bool = False) -> RunConfig:
    """`data` as a RunConfig; ConfigError naming `source` and each problem otherwise."""
    try:
        return RunConfig.model_validate(data, context={"sft": sft})
    except ValidationError as e:
        raise explain(e, source, RunConfig) from None


# model fields that describe the built-in model only
BUILT_IN_MODEL_FIELDS = {"hidden_size", "layers", "heads", "kv_heads", "family", "experts",
                         "experts_per_token"}


def dump_config(cfg: RunConfig, architecture: str | None = None) -> str:
    """The configuration as YAML. With model.path set the built-in model's fields are left
    out (they would describe a model that is not trained), and `architecture`, a line
    describing the checkpoint trained, heads the file as a comment."""
    exclude: dict[str, Any] = {"model": BUILT_IN_MODEL_FIELDS} if cfg.model.path else {}
    if PRESETS[cfg.algo.name].online:  # DPO's beta means nothing here (rlloom/trl_names.py)
        exclude["algo"] = {"beta"}
    text = yaml.safe_dump(cfg.model_dump(mode="json", exclude=exclude or None), sort_keys=False)
    return f"# model trained: {architecture}\n{text}" if architecture else text
