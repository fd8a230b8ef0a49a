"""The model families rlloom implements, one module each: how its Hugging Face config.json
reads into `ModelConfig` (beyond the fields every family shares), how it is written back, and
how its checkpoint's weight names map onto rlloom's modules (`model.layers.0.self_attn.q_proj`,
...), in both directions. Adding a family is a module here and a line in `_MODULES`; the block
variations it needs are flags of `ModelConfig` that `rlloom.models.transformer` reads.

Each module's docstring says what differs from Llama; docs/models.md lists them.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# weights (torch tensors) by name; the `cfg` the functions below take is a
# `rlloom.models.config.ModelConfig` (not imported: that module imports this one)
State = dict[str, Any]


class UnsupportedArchitectureError(ValueError):
    pass


def _same(state: State, cfg: Any) -> State:
    return state


@dataclass(frozen=True)
class Family:
    name: str                    # transformers' model_type
    arch: str                    # the causal LM's architecture name
    # (config.json, transformers' config object of it) -> ModelConfig fields of this family
    read: Callable[[dict[str, Any], Any], dict[str, Any]]
    # ModelConfig -> the config.json fields this family writes beyond the shared ones
    write: Callable[[Any], dict[str, Any]]
    moe: bool = False
    # checkpoint weight names -> rlloom's, and back (fused projections split and re-fused)
    from_checkpoint: Callable[[State, Any], State] = field(default=_same)
    to_checkpoint: Callable[[State, Any], State] = field(default=_same)
    # a PEFT adapter of rlloom's module names loads into this family's transformers model
    peft_names: bool = True
    # config.json names of this family -> the shared ones (GPT-2's n_embd: hidden_size)
    hf_names: dict[str, str] = field(default_factory=dict)
    # the image-text architecture whose language model this family is (its `text_config`
    # and `language_model` weights are read, the vision tower left out)
    multimodal_arch: str | None = None


_TEXT = (("language_model.model.", "model."), ("model.language_model.", "model."),
         ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


def language_model_state(state: State) -> State:
    """An image-text checkpoint's language model under a causal LM's names (its vision
    tower and projector left out); any other checkpoint's state as it is."""
    out = {}
    for name, t in state.items():
        if name.startswith(_VISION):
            continue
        for theirs, ours in _TEXT:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        out[name] = t
    return out


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the causal LM inside an image-text checkpoint whose language
    model a family implements (the head tied as the whole model ties it), else `hf`."""
    archs = hf.get("architectures") or []
    family = next((f for f in FAMILIES.values() if f.multimodal_arch in archs), None)
    if family is None:
        return hf
    # released configs list only the text model's non-default fields: transformers' text
    # config class fills in the rest
    from transformers import CONFIG_MAPPING
    given = {k: v for k, v in hf["text_config"].items() if k != "model_type"}
    text = CONFIG_MAPPING[family.name](**given).to_dict()
    # the whole model's own fields win: its head's tying, its token ids (Gemma 3 stops at
    # <end_of_turn> too), a quantisation (refused)
    outer = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
             "quantization_config")
    return {**text, **{k: hf[k] for k in outer if hf.get(k) is not None},
            "architectures": [family.arch], "model_type": family.name}


def shared_names(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """`hf` (a config.json of `family`, a transformers model type) with the family's own
    names of the shared fields read under the shared names too; its own name wins over a
    stray shared one."""
    names = FAMILIES[family].hf_names if family in FAMILIES else {}
    return {**hf, **{shared: hf[own] for own, shared in names.items() if own in hf}}


_MODULES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmo2", "phi3",
            "gemma2", "gemma3_text", "gpt2", "gpt_oss", "smollm3", "deepseek_v3")
FAMILIES: dict[str, Family] = {}
for _name in _MODULES:
    _family = importlib.import_module(f"{__name__}.{_name}").FAMILY
    FAMILIES[_family.name] = _family
