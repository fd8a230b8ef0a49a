"""Qwen2: Llama with biases on q/k/v (never on o_proj), and a sliding window on the layers
from `max_window_layers` on when `use_sliding_window` is set."""
from __future__ import annotations

from typing import Any

from rlloom.models.families import Family


def read(hf: dict[str, Any], norm: Any) -> dict[str, Any]:
    return dict(qkv_bias=True, o_bias=False)


def write(cfg: Any) -> dict[str, Any]:
    return windows(cfg)


def windows(cfg: Any) -> dict[str, Any]:
    """Qwen's spelling of sliding-window layers (Qwen2, Qwen3, Qwen3-MoE)."""
    if cfg.sliding_window is None:
        return {}
    return dict(use_sliding_window=True, sliding_window=cfg.sliding_window,
                max_window_layers=min(cfg.sliding_layers, default=cfg.num_layers),
                layer_types=["sliding_attention" if i in cfg.sliding_layers
                             else "full_attention" for i in range(cfg.num_layers)])


FAMILY = Family("qwen2", "Qwen2ForCausalLM", read, write)
