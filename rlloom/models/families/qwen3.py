"""Qwen3: Llama with an RMSNorm on each head's queries and keys before the rotary embedding
(`q_norm`, `k_norm` of head_dim), and Qwen's sliding-window spelling."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family
from rlloom.models.families.qwen2 import windows


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                qk_norm=True)


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias, **windows(cfg)}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", read, write)
