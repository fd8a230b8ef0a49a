"""gpt-oss: a Mixtral-like model (routed experts on every layer, no shared expert, sliding
windows on alternate layers, yarn rope) with OpenAI's changes: each attention head has a
learned sink logit that joins its softmax's denominator (`self_attn.sinks`); every
projection is biased, the router and the experts included; the router softmaxes its top k
logits (the same weights as Mixtral's renormalised top k); an expert's activation is a
clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate,
limit). Checkpoints hold each layer's experts fused (`mlp.experts.gate_up_proj` [experts,
hidden, 2 * ffn] with gate and up interleaved column by column, `down_proj` [experts, ffn,
hidden], and their biases); rlloom splits them into one module per expert on load and fuses
them again on export. The released checkpoints' MXFP4 weights are refused (any quantised
checkpoint is: `ModelConfig.from_hf`)."""
from __future__ import annotations

import re
from typing import Any

from rlloom.models.families import Family, State


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return dict(qkv_bias=bias, o_bias=bias, attn_sinks=True,
                n_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                router_bias=True, expert_bias=True,
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


def write(cfg: Any) -> dict[str, Any]:
    types = ["sliding_attention" if cfg.layer_window(i) else "full_attention"
             for i in range(cfg.num_layers)]
    return {"attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window,
            "layer_types": types, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token, "swiglu_limit": cfg.swiglu_limit,
            "swiglu_alpha": cfg.swiglu_alpha}


_FUSED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def from_checkpoint(state: State, cfg: Any) -> State:
    out = {}
    for name, t in state.items():
        fused = _FUSED.match(name)
        if fused is None:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
            continue
        block, kind, bias = fused.groups()
        leaf = "bias" if bias else "weight"
        for e in range(t.shape[0]):
            expert = f"{block}.experts.{e}"
            if kind == "down_proj":  # [ffn, hidden]: a Linear's weight transposed
                out[f"{expert}.down_proj.{leaf}"] = t[e] if bias else t[e].t().contiguous()
                continue
            w = t[e] if bias else t[e].t()   # [2 ffn, (hidden)], gate and up interleaved
            out[f"{expert}.gate_proj.{leaf}"] = w[0::2].contiguous()
            out[f"{expert}.up_proj.{leaf}"] = w[1::2].contiguous()
    return out


def to_checkpoint(state: State, cfg: Any) -> State:
    import torch
    out, experts = {}, {}
    for name, t in state.items():
        m = re.match(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$", name)
        if m is None:
            out[name.replace(".mlp.gate.", ".mlp.router.")] = t
        else:
            experts[(m[1], int(m[2]), m[3], m[4])] = t
    for block in sorted({key[0] for key in experts}):
        n = cfg.n_experts
        for leaf, suffix in (("weight", ""), ("bias", "_bias")):
            def part(kind: str, e: int) -> torch.Tensor:
                t = experts[(block, e, kind, leaf)]
                return t if leaf == "bias" else t.t()
            # gate and up interleaved column by column: [.., ffn, 2] flattened
            gate_up = [torch.stack([part("gate", e), part("up", e)], -1).flatten(-2)
                       for e in range(n)]
            out[f"{block}.experts.gate_up_proj{suffix}"] = torch.stack(gate_up).contiguous()
            out[f"{block}.experts.down_proj{suffix}"] = torch.stack(
                [part("down", e) for e in range(n)]).contiguous()
    return out


FAMILY = Family("gpt_oss", "GptOssForCausalLM", read, write, moe=True,
                from_checkpoint=from_checkpoint, to_checkpoint=to_checkpoint, peft_names=False)
