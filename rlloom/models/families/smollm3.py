"""SmolLM3: Llama (tied head by default) whose every fourth layer uses no positional
embedding at all (NoPE: `no_rope_layers`, 1 where a layer rotates, 0 where it does not).
Its optional sliding window applies only with `use_sliding_window` (off in the released
checkpoints)."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    every = hf.get("no_rope_layer_interval", 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % every != 0)
                                        for i in range(hf["num_hidden_layers"])]
    window = {} if hf.get("use_sliding_window", False) else dict(
        sliding_window=None, sliding_layers=())
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                nope_layers=tuple(i for i, r in enumerate(rope) if not r),
                tie_word_embeddings=hf.get("tie_word_embeddings", True), **window)


def write(cfg: Any) -> dict[str, Any]:
    return {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)],
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window}


FAMILY = Family("smollm3", "SmolLM3ForCausalLM", read, write)
