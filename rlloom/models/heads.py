"""Scalar heads on the decoder backbone: a critic / reward model, and a shared actor-critic."""
from __future__ import annotations

import torch
from torch import nn

from rlloom.models.config import ModelConfig
from rlloom.models.lora import is_adapter_key
from rlloom.models.transformer import Backbone, CausalLM


class ValueModel(nn.Module):
    """Backbone + `score` head giving one value per position [batch, seq].

    The head is named like Hugging Face's `*ForSequenceClassification` head so reward-model
    checkpoints with one label load as they are.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.score(self.model(input_ids, attention_mask)).squeeze(-1)

    @classmethod
    def from_policy(cls, policy: CausalLM) -> "ValueModel":
        """A critic initialised from the policy's backbone with a zero head (values start at 0)."""
        critic = cls(policy.config)
        # a LoRA policy's adapters start at zero (B = 0): the base weights are its backbone
        critic.model.load_state_dict({k: v for k, v in policy.model.state_dict().items()
                                      if not is_adapter_key(k)})
        nn.init.zeros_(critic.score.weight)
        return critic.to(next(policy.parameters()).dtype)


class ActorCritic(CausalLM):
    """One backbone, two heads: next-token logits and per-position values."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)
        nn.init.zeros_(self.score.weight)

    @classmethod
    def from_policy(cls, policy: CausalLM) -> "ActorCritic":
        """The policy's weights with a zero value head added."""
        model = cls(policy.config)
        model.load_state_dict(policy.state_dict(), strict=False)
        return model.to(next(policy.parameters()).dtype)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values [batch, seq] alone (assessment needs no logits)."""
        return self.score(self.model(input_ids, attention_mask)).squeeze(-1)
