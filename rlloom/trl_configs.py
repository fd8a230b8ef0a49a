"""TRL's config objects (`GRPOConfig`, `DPOConfig`, `SFTConfig`) given to `rlloom.train`,
`rlloom.prepare` or `rlloom.sft`: the fields the user set, in TRL's names, for the same
translation as a YAML file written with them (rlloom/trl_names.py).

A field counts as set when it differs from the value TRL itself gives it (its default, or
what its `__post_init__` derives from the other fields: `generation_batch_size` from
`per_device_train_batch_size`, `bf16` from the device). Every set field that means nothing
here is refused, all in one message. The object is TRL's whole config, so where TRL's defaults
differ from rlloom's (the learning rate and its schedule, the KL coefficient, the lengths, the
loss's normalisation, one update per generation of one prompt) the object's values hold too,
under the overrides given with it: `defaults` below.
"""
from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Any

from rlloom.algos.presets import PRESETS
from rlloom.config_errors import ConfigError
from rlloom.trl_names import (GENERATION, MAPPED, OPTIMIZER_STEPS, POINTERS, REFUSED,
                              TRL_DEFAULTS, rlloom_key)

# the device TRL found when the object was built, not a choice of the user's
_FROM_THE_MACHINE = {"use_cpu", "dataloader_pin_memory"}
_RL_NAMES = {*MAPPED, *OPTIMIZER_STEPS, *GENERATION, *REFUSED, "num_iterations", "beta", "seed"}
# TRL's names `trl_names.rlloom_key` does not map alone (beta depends on the preset; an
# object's defaults are GRPOConfig's, online)
_KEYS = {"beta": "algo.kl_coef"}
# the switch TRL's eval_steps needs (rlloom evaluates every eval.every steps)
_EVAL_SWITCHES = {"eval_strategy": "steps", "do_eval": True}
# DPOConfig: TRL's loss_type list -> rlloom's algo.preference_loss
_PREFERENCE_LOSSES = {("sigmoid",): "dpo", ("ipo",): "ipo"}
# SFTConfig -> rlloom's sft section; its batch is per_device x accumulation (one device)
_SFT_NAMES = {"learning_rate": "sft.lr", "max_steps": "sft.steps", "seed": "seed"}


def is_trl_config(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and type(obj).__module__.startswith("trl.")


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _built(cls: type, fields: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of `cls(**fields)` on a CPU (TRL refuses its bf16 default without a GPU), or
    None where TRL refuses the combination."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation notices
        try:
            obj = cls(**{**fields, "use_cpu": True})
        except (ValueError, TypeError):
            return None
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}


def set_fields(config: Any) -> dict[str, Any]:
    """The fields of a TRL config object that differ from what TRL gives them unasked."""
    cls = type(config)
    values = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)
              if f.init and f.name not in _FROM_THE_MACHINE}
    alone = _built(cls, {})
    changed = {k: v for k, v in values.items() if alone is None or v != alone[k]}

    def default(f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    derived = {f.name for f in dataclasses.fields(cls)
               if alone is not None and f.init and _plain(default(f)) != alone[f.name]}
    given = {k: v for k, v in changed.items() if k not in derived}
    # a field the others make (torch_compile sets torch_compile_backend) is not the user's;
    # of two that make each other, the one declared first stays
    for name in reversed(list(given)):
        if _follows(cls, given, name):
            del given[name]
    again = _built(cls, given)
    return {**given, **{k: v for k, v in changed.items()
                        if k in derived and (again is None or v != again[k])}}


def _follows(cls: type, given: dict[str, Any], name: str) -> bool:
    """Whether TRL gives field `name` its value in `given` from the other fields alone."""
    built = _built(cls, {k: v for k, v in given.items() if k != name})
    return built is not None and built[name] == given[name]


def _refusal(name: str) -> str:
    if name in REFUSED:
        return f"{name!r} is TRL's: {REFUSED[name]}"
    if name in POINTERS:
        return f"{name!r}: rlloom's is {POINTERS[name]}"
    return f"{name!r} has no counterpart in rlloom"


_GENERATION_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps",
                      "generation_batch_size", "steps_per_generation")


def _generation(config: Any) -> dict[str, Any]:
    """A GRPOConfig's generation in TRL's names: its (post-init) generation_batch_size
    completions of num_generations per prompt, and per pass steps_per_generation micro-batches
    of which gradient_accumulation_steps make one optimizer step."""
    accumulation = config.gradient_accumulation_steps
    if config.steps_per_generation % accumulation:
        raise ConfigError(f"steps_per_generation={config.steps_per_generation} is not a "
                          f"multiple of gradient_accumulation_steps={accumulation}: TRL would "
                          "leave a partial optimizer step; give a multiple")
    return {"steps_per_generation": config.steps_per_generation // accumulation,
            "generation_batch_size": config.generation_batch_size,
            "num_generations": config.num_generations}


def _generation_shape(fields: dict[str, Any], config: Any) -> None:
    """The batch fields set, as the generation they make."""
    if set(_GENERATION_FIELDS) & fields.keys():
        for name in _GENERATION_FIELDS:
            fields.pop(name, None)
        fields.update(_generation(config))


def rl_config(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A GRPOConfig or DPOConfig as a config dict in TRL's names (ConfigError naming every
    field that has no meaning here), and TRL's values of the fields it leaves where rlloom's
    defaults differ, for `fill_defaults` after the overrides."""
    kind = type(config).__name__
    if kind == "SFTConfig":
        raise ConfigError("an SFTConfig configures supervised fine-tuning, which rlloom runs "
                          "with rlloom.sft(config, out=...) (or `rlloom sft`); rlloom.train "
                          "runs RL: give it a GRPOConfig, DPOConfig, YAML file or RunConfig")
    fields = set_fields(config)
    data: dict[str, Any] = {}
    if kind == "DPOConfig":
        data["algo"] = {"name": "dpo"}
        loss = tuple(fields.pop("loss_type", ["sigmoid"]))
        if loss not in _PREFERENCE_LOSSES:
            raise ConfigError(f"loss_type={list(loss)}: rlloom's offline losses are "
                              "['sigmoid'] (algo.preference_loss=dpo) and ['ipo'] (ipo)")
        data["algo"]["preference_loss"] = _PREFERENCE_LOSSES[loss]
        _pairs_per_step(fields, config, data)
        trl_values = {k: _plain(getattr(config, k)) for k in ("learning_rate",
                                                              "lr_scheduler_type")}
        # pairs per step (verl's name for train.prompts_per_step): per device x accumulation
        trl_values["train_batch_size"] = _batch(config)
    else:
        _generation_shape(fields, config)
        trl_values = {**{name: _plain(getattr(config, name))
                         for name, _, _ in TRL_DEFAULTS.values()}, **_generation(config)}
    defaults = {k: v for k, v in trl_values.items() if k not in fields}
    for name, value in _EVAL_SWITCHES.items():  # what makes TRL's eval_steps count
        if fields.get(name) == value:
            del fields[name]
    if config.use_cpu:
        data.setdefault("train", {})["device"] = "cpu"
    refused = [k for k in fields if k not in _RL_NAMES or k in REFUSED]
    if refused:
        raise ConfigError(f"{kind} sets fields rlloom cannot honour: "
                          + "; ".join(_refusal(k) for k in refused))
    return {**data, **fields}, defaults


def fill_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> None:
    """`defaults` (TRL names) into `data` where neither that name nor its rlloom key is set,
    nor a preset the overrides chose sets that key (algo=dr_grpo's loss_agg)."""
    algo = data.get("algo")
    preset = algo if isinstance(algo, str) else (algo or {}).get("name", "grpo")
    chosen = PRESETS[preset].overrides if preset in PRESETS else {}
    def given(key: str) -> bool:
        section, _, field = key.partition(".")
        node = data.get(section)
        return isinstance(node, dict) and field in node or section == "algo" and field in chosen
    for name, value in defaults.items():
        # a group size of the user's own makes TRL's generation size mean other prompts
        if name in data or given(_KEYS.get(name) or rlloom_key(name) or "") or \
                name == "generation_batch_size" and given("rollout.n_samples"):
            continue
        data[name] = value


def _batch(config: Any) -> int:
    """Rows per optimizer step on one device: TRL's per-device batch x its accumulation."""
    return config.per_device_train_batch_size * config.gradient_accumulation_steps


def _pairs_per_step(fields: dict[str, Any], config: Any, data: dict[str, Any]) -> None:
    """A DPO step's pairs: TRL's per-device batch times its accumulation (one device)."""
    batch = {"per_device_train_batch_size", "gradient_accumulation_steps"}
    if batch & fields.keys():
        for name in batch:
            fields.pop(name, None)
        data.setdefault("train", {})["prompts_per_step"] = _batch(config)


def sft_overrides(config: Any) -> list[str]:
    """An SFTConfig as rlloom overrides of the sft section (ConfigError naming every field
    that has no meaning here)."""
    if type(config).__name__ != "SFTConfig":
        raise ConfigError(f"rlloom.sft takes an SFTConfig, YAML file or RunConfig, not a "
                          f"{type(config).__name__}")
    fields = set_fields(config)
    fields.pop("output_dir", None)  # rlloom.sft's `out`
    overrides = [f"{_SFT_NAMES[k]}={fields.pop(k)!r}" for k in list(fields) if k in _SFT_NAMES]
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        fields.pop(name, None)
    # TRL's learning rate and batch hold when left at its defaults (2e-5, 8 per device)
    if not any(o.startswith("sft.lr=") for o in overrides):
        overrides.append(f"sft.lr={config.learning_rate!r}")
    overrides.append(f"sft.batch_size={_batch(config)}")
    if fields:
        raise ConfigError("SFTConfig sets fields rlloom cannot honour: "
                          + "; ".join(_refusal(k) for k in fields))
    return overrides
