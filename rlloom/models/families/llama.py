"""Llama (and Llama 3's scaled rope): the reference block every other family is described
against. Pre-norm RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP; optional
biases on the attention projections (`attention_bias`) and the MLP (`mlp_bias`)."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}


FAMILY = Family("llama", "LlamaForCausalLM", read, write)
