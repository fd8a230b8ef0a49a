"""Token embeddings of the supported families: plain, Gemma's scaled, GPT-2's with a learned
table of positions added (and the check that a generation stays inside that table)."""
from __future__ import annotations

import torch
from torch import nn

from rlloom.models.config import ModelConfig


class Embedding(nn.Embedding):
    """Token embeddings. Every caller passes the tokens' positions [like ids]: a rotary
    family ignores them here (they enter attention), GPT-2 adds its learned table's rows."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        return super().forward(ids)


class ScaledEmbedding(Embedding):
    """Gemma's embedding: the rows times sqrt(hidden_size), in the weights' dtype."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        scale = torch.tensor(self.embedding_dim ** 0.5, dtype=self.weight.dtype)
        return super().forward(ids) * scale.to(self.weight.device)


class PositionedEmbedding(Embedding):
    """GPT-2's embedding: token rows plus the rows of a learned table of positions."""

    def __init__(self, vocab: int, dim: int, positions: int) -> None:
        super().__init__(vocab, dim)
        self.positions = nn.Embedding(positions, dim)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        if positions is None:
            raise ValueError("a model with learned positions embeds tokens with their positions")
        return super().forward(ids) + self.positions(positions)


def check_positions(cfg: ModelConfig, prompt: int, new_tokens: int) -> None:
    """Refuse a generation longer than a learned position table (GPT-2's 1,024 rows): past
    it there is no embedding to look up."""
    if cfg.learned_positions and prompt + new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompts of up to {prompt} tokens plus {new_tokens} new ones exceed the "
            f"{cfg.max_position_embeddings} positions this {cfg.family} model has learned "
            "(max_position_embeddings); lower rollout.max_new_tokens (and eval.max_new_tokens)"
            " or data.max_prompt_tokens")


def embedding(cfg: ModelConfig) -> Embedding:
    if cfg.learned_positions:
        return PositionedEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings)
    return (ScaledEmbedding if cfg.embed_scale else Embedding)(cfg.vocab_size, cfg.hidden_size)
