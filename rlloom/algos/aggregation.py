"""Loss aggregation: per-token losses [n, T] -> one scalar with mini-batch-global normalisers.

The normalisers in `LossNorm` count the WHOLE mini-batch (all micro-batches, all data-parallel
ranks), so every mode is a sum of per-sequence terms over a constant. Summing micro-batch
losses, or all-reducing gradients with SUM across ranks, therefore reproduces the gradient of
the whole mini-batch exactly, however it is split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlloom.algos.masks import valid
from rlloom.algos.registry import Registry


@dataclass
class LossNorm:
    tokens: float  # valid-token count of the whole mini-batch
    seqs: float  # sequence count of the whole mini-batch
    const: float = 1.0  # Dr. GRPO's constant, usually the generation budget in tokens

    def __post_init__(self) -> None:
        if self.tokens <= 0 or self.seqs <= 0 or self.const <= 0:
            raise ValueError(f"LossNorm needs positive tokens, seqs and const, got {self}; an "
                             "empty mini-batch has nothing to train on")

    @classmethod
    def of(cls, mask: torch.Tensor, const: float = 1.0) -> LossNorm:
        """Normalisers of a mini-batch held whole in one process (mask [n, T])."""
        return cls(tokens=float(valid(mask).sum()), seqs=float(mask.shape[0]), const=const)


# fn(loss [n, T], mask [n, T], norm) -> scalar
Aggregation = Callable[[torch.Tensor, torch.Tensor, LossNorm], torch.Tensor]
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _token_sums(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t loss * mask per sequence  # [n]."""
    return torch.where(valid(mask), loss, 0).sum(dim=-1)


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """sum(loss * mask) / norm.tokens: every token of the mini-batch weighs the same."""
    return _token_sums(loss, mask).sum() / norm.tokens


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """sum_i (sum_t loss * mask) / norm.seqs."""
    return _token_sums(loss, mask).sum() / norm.seqs


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
    """sum_i (sum_t loss * mask / n_tokens_i) / norm.seqs; an empty sequence adds 0."""
    n_tokens = valid(mask).sum(dim=-1).clamp(min=1)
    return (_token_sums(loss, mask) / n_tokens).sum() / norm.seqs


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: LossNorm
                            ) -> torch.Tensor:
    """sum(loss * mask) / (norm.seqs * norm.const): Dr. GRPO's length-unbiased mean."""
    return _token_sums(loss, mask).sum() / (norm.seqs * norm.const)
