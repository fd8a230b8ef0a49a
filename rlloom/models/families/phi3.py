"""Phi-3: Llama (with Mistral's sliding window when set) whose checkpoints fuse q, k and v
into one `qkv_proj` and gate and up into one `gate_up_proj`; rlloom splits them on load and
fuses them on export. The 128k checkpoints' (Phi-3-128k, Phi-3.5) longrope switches to its
long factors once a sequence passes the original length; Phi-4-mini rotates 3/4 of each
head's dimensions (partial_rotary_factor)."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family, State


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    rope = getattr(norm, "rope_parameters", None) or {}
    return {"partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0))}


def write(cfg: Any) -> dict[str, Any]:
    return {"sliding_window": cfg.sliding_window,
            "partial_rotary_factor": cfg.partial_rotary_factor}


def from_checkpoint(state: State, cfg: Any) -> State:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {}
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, w in zip(("q", "k", "v"), t.split([q, kv, kv])):
                out[f"{base}{part}_proj.weight"] = w
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[f"{base}gate_proj.weight"], out[f"{base}up_proj.weight"] = t.chunk(2)
        else:
            out[name] = t
    return out


def to_checkpoint(state: State, cfg: Any) -> State:
    import torch
    out = dict(state)
    for name in [n for n in state if n.endswith("self_attn.q_proj.weight")]:
        base = name.removesuffix("q_proj.weight")
        out[f"{base}qkv_proj.weight"] = torch.cat([out.pop(f"{base}{p}_proj.weight")
                                                   for p in "qkv"])
    for name in [n for n in state if n.endswith("mlp.gate_proj.weight")]:
        base = name.removesuffix("gate_proj.weight")
        out[f"{base}gate_up_proj.weight"] = torch.cat([out.pop(f"{base}gate_proj.weight"),
                                                       out.pop(f"{base}up_proj.weight")])
    return out


FAMILY = Family("phi3", "Phi3ForCausalLM", read, write, from_checkpoint=from_checkpoint,
                to_checkpoint=to_checkpoint, peft_names=False)
