"""The policy a run builds from its checkpoint (with LoRA adapters when asked) and the
checkpoint it writes when it ends."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rlloom.algos.presets import PRESETS
from rlloom.config import RunConfig
from rlloom.config_sections import ModelSection
from rlloom.models.families import FAMILIES
from rlloom.models.heads import ActorCritic, ValueModel
from rlloom.models.hf_io import (
    DTYPES,
    load_model,
    load_tokenizer,
    load_value_model,
    read_model_config,
    require_policy_tokenizer,
    save_adapter,
    save_checkpoint,
)
from rlloom.models.lora import apply_lora, merged_state, peft_config


def build_policy(cfg: RunConfig, model_path: Path) -> torch.nn.Module:
    """The policy as the trainer builds it (an ActorCritic when the critic shares it), with
    LoRA adapters when `model.lora` asks for them (then only they, and a shared value head,
    train)."""
    policy = load_model(model_path, DTYPES[cfg.model.dtype])
    if "critic" in PRESETS[cfg.algo.name].roles and cfg.plan.actor_critic == "shared":
        policy = ActorCritic.from_policy(policy)
    lora = cfg.model.lora
    if lora is not None:
        apply_lora(policy, lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), cfg.seed)
        if isinstance(policy, ActorCritic):
            policy.score.requires_grad_(True)
    return policy


def build_critic(model: ModelSection, model_path: Path, policy: torch.nn.Module) -> ValueModel:
    """A separate critic: from `model.critic_path` when given (a reward model's trained head,
    or a causal LM's backbone with a zero head), else from the policy's backbone. It reads
    the policy's token ids, so its tokenizer must be the policy's."""
    path = model.critic_path
    if path is None:
        return ValueModel.from_policy(policy)
    dtype = DTYPES[model.dtype]
    read_model_config(Path(path))  # a clear error when it is no checkpoint
    architectures = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    critic = (load_value_model(path, dtype)
              if any(a.endswith("ForSequenceClassification") for a in architectures or ())
              else ValueModel.from_policy(load_model(path, dtype)))
    require_policy_tokenizer(path, critic.config.vocab_size, load_tokenizer(model_path),
                             "model.critic_path")
    return critic


def save_final(cfg: RunConfig, model_path: Path, weights: dict[str, torch.Tensor], path: Path
               ) -> None:
    """The trained policy's whole weights as a Hugging Face checkpoint at `path`; a LoRA
    policy's with its adapters merged, and the adapters alone in PEFT's format in
    `path/adapter` (for `peft` to load onto the base checkpoint) where the family's module
    names are transformers' (not Phi-3's fused projections, not Mixtral's experts)."""
    tokenizer = load_tokenizer(model_path, cfg.data.chat_template)
    policy = build_policy(cfg, model_path)
    policy.load_state_dict(weights)
    lora = cfg.model.lora
    if lora is None:
        save_checkpoint(policy, tokenizer, path)
        return
    merged = load_model(model_path, DTYPES[cfg.model.dtype])
    merged.load_state_dict({k: v for k, v in merged_state(policy, weights).items()
                            if k.startswith(("model.", "lm_head."))})
    save_checkpoint(merged, tokenizer, path)
    family = FAMILIES[policy.config.family]
    if not family.peft_names:  # PEFT would look for modules transformers names otherwise
        print(f"final/ holds the adapters merged; no final/adapter: {family.arch} fuses or "
              "names its projections unlike rlloom's modules, so PEFT could not load them")
        return
    save_adapter(weights, peft_config(lora.rank, lora.alpha, lora.dropout,
                                      tuple(lora.targets), str(model_path)), path / "adapter")
