"""The pieces every attention of the decoder shares (`transformer.Attention`,
`mla.LatentAttention`): the families' norms and the rotary rotation."""
from __future__ import annotations

import torch
from torch import nn

from rlloom.models.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) times the weight, or (`offset`, Gemma) times 1 + the weight in fp32."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, so bf16 runs match it (and
        # fp64 in fp64, for the tight tests of parallel layouts).
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (1.0 + self.weight.to(wide))).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm | nn.LayerNorm:
    """The family's norm over `dim` features (default: the hidden size): RMSNorm, or GPT-2's
    LayerNorm."""
    if cfg.layer_norm:
        return nn.LayerNorm(dim or cfg.hidden_size, cfg.rms_norm_eps)
    return RMSNorm(dim or cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] rotated over its first cos.shape[-1] dimensions (all of them but
    with a partial rotary factor), the rest passed through."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
