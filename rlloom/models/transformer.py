"""Plain-PyTorch decoder for the Llama / Qwen2 / Qwen3 family (dense, and Qwen3-MoE).

Module names mirror the Hugging Face checkpoints (`model.layers.0.self_attn.q_proj`, ...) so a
state dict loads without renaming. No distributed code lives here (DESIGN.md): parallel
layouts are applied to these modules from outside.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlloom.models.cache import KVCache
from rlloom.models.config import ModelConfig
from rlloom.models.moe import MoEBlock


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, so bf16 runs match it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin  # [batch, 1, seq, head_dim] for integer positions [batch, seq]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim)
    freqs = positions.float()[..., None] * inv_freq          # [batch, seq, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, d, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, cache: KVCache | None, layer: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.hd)
        k = self.k_proj(x).view(b, s, self.n_kv, self.hd)
        v = self.v_proj(x).view(b, s, self.n_kv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)   # [b, heads, s, hd]
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.n_heads != self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEBlock(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, cache: KVCache | None, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embeddings, decoder layers and the final norm: everything but the output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states [batch, seq, hidden]; extends `cache` when given."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        past = cache.key_mask[:, :cache.length] if cache is not None else None
        positions, mask = positions_and_mask(attention_mask, past)
        if cache is not None:
            cache.append_mask(attention_mask)
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta,
                                  x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(x)


def positions_and_mask(new_mask: torch.Tensor, past_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary positions [batch, new] and attention mask [batch, 1, new, past+new].

    Masks are 1 for real tokens and 0 for padding, so left-padded prompts and finished rows
    keep the positions of an unpadded sequence. A query always sees itself, which keeps
    padding rows finite without changing any real token's output.
    """
    b, s = new_mask.shape
    past = past_mask if past_mask is not None else new_mask.new_zeros(b, 0)
    keys = torch.cat([past, new_mask], dim=1).bool()                     # [b, p+s]
    positions = past.sum(1, keepdim=True) + new_mask.cumsum(1) - 1
    p = past.shape[1]
    causal = torch.ones(s, p + s, dtype=torch.bool, device=new_mask.device).tril(p)
    own = torch.zeros_like(causal)
    own[:, p:] = torch.eye(s, dtype=torch.bool, device=new_mask.device)
    mask = (causal & keys[:, None, :]) | own
    return positions.clamp(min=0), mask[:, None]


class CausalLM(nn.Module):
    """Decoder with a language-model head; `forward` returns logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, attention_mask, cache))

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
