"""Gemma 3 (text): Gemma 2's block (norms before and after each sublayer, 1 + weight norms,
scaled embeddings, query_pre_attn_scalar, tied head, sliding windows by `layer_types`) with an
RMSNorm on each head's queries and keys, no soft-capping by default, and a rotary base of its
own on the sliding layers (`rope_parameters.sliding_attention`, 10,000) beside the full
layers' (`full_attention`, 1,000,000), which the larger checkpoints scale (linear, factor 8
for Gemma 3 4B-27B). Scaled rope on the sliding layers is refused (no checkpoint has it).
Gemma 3 4B-27B are released as image-text checkpoints (`Gemma3ForConditionalGeneration`):
rlloom reads their language model (`text_config`, the `language_model` weights) and leaves
the vision tower and its projector out; the export is the text-only `Gemma3ForCausalLM`."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family, UnsupportedArchitectureError
from rlloom.models.families.gemma2 import read as gemma2_read
from rlloom.models.families.gemma2 import write as gemma2_write


def _ropes(hf: dict[str, Any], norm: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    # transformers' reading (an older config's rope_scaling lands in full_attention there)
    rope = getattr(norm, "rope_parameters", None) or hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        rope = {**rope, "full_attention": {**rope.get("full_attention", {}), **scaling}}
    full = {"rope_theta": hf.get("rope_theta", 1e6), **(rope.get("full_attention") or {})}
    local = rope.get("sliding_attention") or {
        "rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    return full, local


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    full, local = _ropes(hf, norm)
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise UnsupportedArchitectureError(
            f"Gemma3 with rope_type {local_type!r} on its sliding_attention layers is not "
            "supported; rlloom scales the full_attention layers' rotary embedding only")
    scaling = {k: v for k, v in full.items() if k not in ("rope_theta", "type")}
    if scaling.setdefault("rope_type", full.get("type", "default")) == "default":
        scaling = {}
    return {**gemma2_read(hf, norm), "qk_norm": True, "rope_theta": full["rope_theta"],
            "rope_scaling": scaling, "local_rope_theta": local["rope_theta"]}


def write(cfg: Any) -> dict[str, Any]:
    return {**gemma2_write(cfg), "rope_parameters": {
        "full_attention": {"rope_type": "default", **cfg.rope_scaling,
                           "rope_theta": cfg.rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}}}


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", read, write,
                multimodal_arch="Gemma3ForConditionalGeneration")
