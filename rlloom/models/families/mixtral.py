"""Mixtral: Mistral whose every MLP is a softmax top-k router over SwiGLU experts, the k
weights renormalised to sum to 1; no shared expert, no dense layer. Checkpoints name the block
`block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down); rlloom's
modules are Qwen3-MoE's (`mlp.gate`, `mlp.experts.N.gate_proj`, ...)."""
from __future__ import annotations

import re
from typing import Any

from rlloom.models.families import Family, State

_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    return dict(n_experts=hf.get("num_local_experts", 8),
                experts_per_token=hf.get("num_experts_per_tok", 2),
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)


def write(cfg: Any) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token}


def from_checkpoint(state: State, cfg: Any) -> State:
    out = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"(.*\.experts\.\d+)\.(w[123])\.weight$", name)
        out[f"{m[1]}.{_EXPERT[m[2]]}.weight" if m else name] = t
    return out


def to_checkpoint(state: State, cfg: Any) -> State:
    back = {v: k for k, v in _EXPERT.items()}
    out = {}
    for name, t in state.items():
        m = re.match(r"(.*)\.mlp\.(experts\.\d+)\.(\w+_proj)\.weight$", name)
        if m:
            name = f"{m[1]}.block_sparse_moe.{m[2]}.{back[m[3]]}.weight"
        out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
    return out


FAMILY = Family("mixtral", "MixtralForCausalLM", read, write, moe=True,
                from_checkpoint=from_checkpoint, to_checkpoint=to_checkpoint,
                peft_names=False)
