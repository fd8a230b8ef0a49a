"""Qwen3-MoE: Qwen3 whose MLP is, on the sparse layers, a softmax top-k router over SwiGLU
experts (no shared expert; the k weights renormalised when `norm_topk_prob`). Layer i is
sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family
from rlloom.models.families.qwen2 import windows


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    # transformers 5 writes num_experts under its attribute_map name num_local_experts
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True,
                n_experts=hf.get("num_experts", hf.get("num_local_experts", 0)),
                experts_per_token=hf.get("num_experts_per_tok", 0),
                moe_intermediate_size=hf.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, **windows(cfg),
            "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers)}


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", read, write, moe=True)
