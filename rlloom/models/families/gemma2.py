"""Gemma 2: Llama with a norm before and after each sublayer (x + norm(attn(norm(x))): the
`input_layernorm`/`post_attention_layernorm` pair around attention and
`pre_feedforward_layernorm`/`post_feedforward_layernorm` around the MLP), RMSNorms that scale
by 1 + weight, embeddings times sqrt(hidden_size), attention scores scaled by
query_pre_attn_scalar ** -0.5 and soft-capped (cap * tanh(scores / cap)), soft-capped final
logits, a GELU-tanh MLP, a tied output head, and a sliding window on alternating layers."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    scalar = hf.get("query_pre_attn_scalar", 256)
    return dict(sandwich_norms=True, norm_offset=True, embed_scale=True,
                attn_scale=float(scalar) ** -0.5,
                attn_softcap=hf.get("attn_logit_softcapping"),
                final_softcap=hf.get("final_logit_softcapping"),
                qkv_bias=bool(hf.get("attention_bias", False)),
                o_bias=bool(hf.get("attention_bias", False)),
                tie_word_embeddings=hf.get("tie_word_embeddings", True))


def query_pre_attn_scalar(cfg: Any) -> int | float:
    """The config field the attention scale came from (an int in transformers' config)."""
    value = cfg.attn_scale ** -2
    return round(value) if abs(value - round(value)) < 1e-6 else value


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "attn_logit_softcapping": cfg.attn_softcap,
            "query_pre_attn_scalar": query_pre_attn_scalar(cfg),
            "final_logit_softcapping": cfg.final_softcap,
            "layer_types": ["sliding_attention" if i in cfg.sliding_layers
                            else "full_attention" for i in range(cfg.num_layers)],
            "sliding_window": cfg.sliding_window}


FAMILY = Family("gemma2", "Gemma2ForCausalLM", read, write)
