"""GPT-2: the simplest model that is not Llama. Learned absolute positions (`wpe`, added to
the token embeddings) instead of rotary ones; LayerNorm with a bias instead of RMSNorm; every
projection biased; a plain two-matrix MLP (`c_fc`, GELU, `c_proj`) instead of a gated one;
full multi-head attention; the head tied to the embeddings. Its config.json spells the shared
fields its own way (`n_embd`, `n_layer`, `n_head`, `n_positions`, `n_inner`), and its
checkpoints hold `Conv1D` weights ([in, out], the transpose of a Linear's) with q, k and v
fused into one `c_attn`: rlloom reads and writes both as GPT-2 does. Refused: layer-scaled
attention (`scale_attn_by_inverse_layer_idx`) and cross-attention."""
from __future__ import annotations

import re
from typing import Any

from rlloom.models.families import Family, State, UnsupportedArchitectureError

# GPT-2's config.json names -> the names every other family uses
NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head":
         "num_attention_heads", "n_positions": "max_position_embeddings",
         "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise UnsupportedArchitectureError(
                f"GPT-2 with {flag}=true is not supported; rlloom implements GPT-2 as "
                "released (every layer's scores scaled by head_dim ** -0.5, no cross-attention)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]  # read under the shared names
    return dict(intermediate_size=hf.get("n_inner") or 4 * d, num_kv_heads=heads,
                head_dim=d // heads, qkv_bias=True, o_bias=True, mlp_bias=True,
                layer_norm=True, gated_mlp=False, learned_positions=True,
                attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
                tie_word_embeddings=hf.get("tie_word_embeddings", True))


def write(cfg: Any) -> dict[str, Any]:
    return {"n_inner": cfg.intermediate_size, "scale_attn_weights": cfg.attn_scale is None}


_LAYER = re.compile(r"^transformer\.h\.(\d+)\.")
# within a layer: GPT-2's module -> rlloom's
_MODULES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
            "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj",
            "mlp.c_proj": "mlp.down_proj"}
_TOP = {"transformer.wte.weight": "model.embed_tokens.weight",
        "transformer.wpe.weight": "model.embed_tokens.positions.weight",
        "transformer.ln_f.weight": "model.norm.weight", "transformer.ln_f.bias": "model.norm.bias"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def from_checkpoint(state: State, cfg: Any) -> State:
    out = {}
    for name, t in state.items():
        if not name.startswith(("transformer.", "lm_head.", "score.")):
            name = "transformer." + name  # the released checkpoints' (GPT2Model's) names
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        layer = _LAYER.match(name)
        if layer is None:  # lm_head, a reward model's score
            out[name] = t
            continue
        module, _, leaf = name[layer.end():].rpartition(".")
        if module == "attn" and leaf in ("bias", "masked_bias"):
            continue  # old checkpoints' causal-mask buffers
        prefix = f"model.layers.{layer.group(1)}."
        if module in _CONV1D and leaf == "weight":
            t = t.t()
        if module == "attn.c_attn":
            for part, w in zip("qkv", t.chunk(3, dim=0)):
                out[f"{prefix}self_attn.{part}_proj.{leaf}"] = w.contiguous()
        else:
            out[f"{prefix}{_MODULES[module]}.{leaf}"] = t.contiguous()
    return out


def to_checkpoint(state: State, cfg: Any) -> State:
    import torch
    back = {ours: theirs for theirs, ours in _TOP.items()}
    modules = {ours: theirs for theirs, ours in _MODULES.items()}
    out: State = {}
    fused: dict[str, dict[str, Any]] = {}
    for name, t in state.items():
        if name in back:
            out[back[name]] = t
            continue
        parts = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if parts is None:
            out[name] = t
            continue
        i, module, leaf = parts.groups()
        prefix = f"transformer.h.{i}."
        qkv = re.match(r"self_attn\.([qkv])_proj$", module)
        if qkv:
            fused.setdefault(f"{prefix}attn.c_attn.{leaf}", {})[qkv.group(1)] = t
            continue
        theirs = modules[module]
        out[f"{prefix}{theirs}.{leaf}"] = t.t().contiguous() if (
            theirs in _CONV1D and leaf == "weight") else t
    for name, qkv in fused.items():
        t = torch.cat([qkv[p] for p in "qkv"])
        out[name] = t.t().contiguous() if name.endswith("weight") else t
    return out


FAMILY = Family("gpt2", "GPT2LMHeadModel", read, write, from_checkpoint=from_checkpoint,
                to_checkpoint=to_checkpoint, peft_names=False, hf_names=NAMES)
