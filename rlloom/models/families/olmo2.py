"""OLMo 2: Llama with the norms after each sublayer instead of before it (x + norm(attn(x)),
then x + norm(mlp(x)): `post_attention_layernorm`, `post_feedforward_layernorm`, no
`input_layernorm`), and an RMSNorm over all heads' queries and over all keys before they are
split into heads (`q_norm` of heads x head_dim, `k_norm` of kv_heads x head_dim)."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True,
                post_norms=True)


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias}


FAMILY = Family("olmo2", "Olmo2ForCausalLM", read, write)
