"""Mistral: Llama with a sliding window on every layer (`sliding_window`, null = off). The
image-text Mistral 3 checkpoints (Mistral Small 3.1/3.2: `Mistral3ForConditionalGeneration`)
are read as their language model, the vision tower left out."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def write(cfg: Any) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window, "attention_bias": cfg.qkv_bias}


FAMILY = Family("mistral", "MistralForCausalLM", read, write,
                multimodal_arch="Mistral3ForConditionalGeneration")
