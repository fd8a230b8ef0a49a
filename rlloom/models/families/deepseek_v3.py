"""DeepSeek-V3 (and the models built on it: DeepSeek-R1, Kimi K2, Moonlight): multi-head
latent attention (`rlloom.models.mla`: keys and values from a compressed latent, queries
through a low-rank bottleneck, a rotary part of qk_rope_head_dim laid out in interleaved
pairs, the scores' scale grown by yarn's mscale_all_dim), dense SwiGLU MLPs on the first
first_k_dense_replace layers and routed experts on the rest: sigmoid scores, chosen (with a
per-expert correction bias, `mlp.gate.e_score_correction_bias`, a buffer: set by
DeepSeek's load balancing, not trained) within the best topk_group of n_group groups,
renormalised and scaled by routed_scaling_factor, plus n_shared_experts every token runs.
The released checkpoints' extra multi-token-prediction layer (model.layers.61) is left out,
as transformers does; their FP8 weights are refused (any quantised checkpoint is)."""
from __future__ import annotations

import math
import re
from typing import Any

from rlloom.models.families import Family, State


def softmax_scale(hf: dict[str, Any], rope: dict[str, Any]) -> float:
    """The scores' scale: 1 / sqrt(q/k head width), times yarn's mscale squared when the
    rope is scaled with an mscale_all_dim (DeepSeek's reference, and transformers')."""
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    factor, m = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", "default") != "default" and m and factor > 1:
        scale *= (0.1 * m * math.log(factor) + 1.0) ** 2
    return scale


# transformers' DeepseekV3Config defaults, for a config.json that leaves a field out
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 3, "rope_interleave": True,
            "attention_bias": False}


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    def get(key: str) -> Any:
        return hf[key] if key in hf else DEFAULTS[key]
    hf = {**hf, "qk_nope_head_dim": get("qk_nope_head_dim"),
          "qk_rope_head_dim": get("qk_rope_head_dim")}
    bias = bool(get("attention_bias"))
    rope = dict(getattr(norm, "rope_parameters", None) or hf.get("rope_parameters")
                or hf.get("rope_scaling") or {})
    return dict(num_kv_heads=hf["num_attention_heads"], head_dim=get("qk_rope_head_dim"),
                kv_lora_rank=get("kv_lora_rank"), q_lora_rank=get("q_lora_rank") or 0,
                qk_nope_head_dim=get("qk_nope_head_dim"), v_head_dim=get("v_head_dim"),
                rope_interleave=bool(get("rope_interleave")),
                attn_scale=softmax_scale(hf, rope), qkv_bias=bias, o_bias=bias,
                n_experts=get("n_routed_experts"), experts_per_token=get("num_experts_per_tok"),
                moe_intermediate_size=get("moe_intermediate_size"),
                n_shared_experts=get("n_shared_experts") or 0, moe_scoring="sigmoid",
                n_group=get("n_group") or 1, topk_group=get("topk_group") or 1,
                routed_scaling_factor=float(get("routed_scaling_factor")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                mlp_only_layers=tuple(range(get("first_k_dense_replace") or 0)))


def write(cfg: Any) -> dict[str, Any]:
    if cfg.mlp_only_layers != tuple(range(len(cfg.mlp_only_layers))) \
            or cfg.decoder_sparse_step != 1:
        raise ValueError(f"a deepseek_v3 config writes its dense layers as the first "
                         f"first_k_dense_replace; mlp_only_layers={cfg.mlp_only_layers}, "
                         f"decoder_sparse_step={cfg.decoder_sparse_step} cannot be written")
    return {"kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave,
            "attention_bias": cfg.qkv_bias, "n_routed_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_group,
            "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
            "norm_topk_prob": cfg.norm_topk_prob,
            "first_k_dense_replace": len(cfg.mlp_only_layers),
            # the released configs' names of this routing, which vLLM reads
            "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def from_checkpoint(state: State, cfg: Any) -> State:
    """The model's own layers: the multi-token-prediction layers after them dropped."""
    def kept(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return m is None or int(m[1]) < cfg.num_layers
    return {name: t for name, t in state.items() if kept(name)}


FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", read, write, moe=True,
                from_checkpoint=from_checkpoint, peft_names=False)  # experts fused there
