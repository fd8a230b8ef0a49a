"""DeepSeek-V3's multi-head latent attention (MLA).

Each token's keys and values come from one compressed latent c = norm(x W_dkv) of
`kv_lora_rank` features and one rotary key k_rope = rope(x W_kr) of `head_dim` features that
every head shares: head h's key is [c W_uk_h, k_rope], its value c W_uv_h (`kv_b_proj` holds
W_uk and W_uv of every head). Queries go through a `q_lora_rank` bottleneck with its own norm
(or one `q_proj`), split the same way into an unrotated and a rotary part. So a cache keeps c
and k_rope: kv_lora_rank + head_dim numbers per token and layer (576 in DeepSeek-V3, where its
128 heads' keys and values would be 40,960).

Teacher-forced passes (training, a prefill) expand the latents into every head's keys and
values and run one fused attention, as transformers does. A decode step (one query per row
over a cache) instead multiplies W_uk into the query and W_uv after the attention, so it
reads the cached latents as they are (the "absorbed" form: the same products, associated
differently), never expanding the whole cache.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from rlloom.models.config import ModelConfig
from rlloom.models.primitives import RMSNorm, apply_rotary


LATENT_EPS = 1e-6


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated in pairs (x0, x1), (x2, x3), ... by the angles of `cos`/`sin`'s
    first half (the rotary tables hold each angle twice), written out as DeepSeek's
    checkpoints lay them: the pairs' first elements, then their second."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


class LatentAttention(nn.Module):
    """Module names as DeepSeek-V3's checkpoints: q_proj (or q_a_proj, q_a_layernorm,
    q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_heads
        self.n_heads, self.rank, self.rope = h, cfg.kv_lora_rank, cfg.head_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        qk = h * cfg.qk_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.qkv_bias)
            # the latents' norms take DeepSeek's eps whatever rms_norm_eps says (as
            # transformers builds them)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_EPS)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=cfg.qkv_bias)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.qk_head_dim ** -0.5
        self.interleave = cfg.rope_interleave
        # what the decoder's engine and parallel layouts read of an attention
        self.rotary, self.sinks, self.softcap = True, None, None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return (rotate_interleaved if self.interleave else apply_rotary)(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: Any, layer: int) -> torch.Tensor:
        """As `transformer.Attention`; `cache.update` takes and gives the latents [b, 1,
        keys, kv_lora_rank] and rotary keys [b, 1, keys, head_dim]."""
        b, s, _ = x.shape
        q = self.queries(x).view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]                   # [b, 1, s, rank]
        q_rope = self.rotate(q_rope, cos, sin)
        k_rope = self.rotate(k_rope[:, None], cos, sin)                 # [b, 1, s, rope]
        if cache is not None:
            latent, k_rope = cache.update(layer, latent, k_rope)
        if s == 1 and cache is not None:
            out = self.absorbed(q_nope, q_rope, latent, k_rope, mask)
        else:
            out = self.expanded(q_nope, q_rope, latent, k_rope, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.v_dim))

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                 k_rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over every head's keys and values expanded from the latents: [b, heads,
        s, v_head_dim]."""
        b, keys, s = latent.shape[0], latent.shape[2], q_nope.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).view(b, keys, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if mask is None and keys > s:  # a context-parallel shard's queries: the last keys
            mask = causal_lower_right(s, keys)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=self.scale)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                 k_rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One query per row over the cached latents as they are: W_uk multiplied into the
        query, W_uv after the attention; [b, heads, 1, v_head_dim]."""
        proj = self.kv_b_proj  # a LoRA layer's merged weight: the product it multiplies by
        w = (proj.merged_weight() if hasattr(proj, "merged_weight") else proj.weight).view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_latent = torch.matmul(q_nope, w_uk.to(q_nope.dtype))           # [b, h, 1, rank]
        scores = (torch.matmul(q_latent, latent.transpose(-1, -2).to(q_latent.dtype))
                  + torch.matmul(q_rope, k_rope.transpose(-1, -2).to(q_rope.dtype)))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        wide = torch.promote_types(scores.dtype, torch.float32)
        probs = (scores * self.scale).softmax(-1, dtype=wide).to(q_latent.dtype)
        mixed = torch.matmul(probs, latent.to(probs.dtype))              # [b, h, 1, rank]
        return torch.matmul(mixed, w_uv.transpose(1, 2).to(mixed.dtype))
