"""Preallocated key/value cache for batched decoding."""
from __future__ import annotations

import torch

from rlloom.models.config import ModelConfig


class KVCache:
    """Keys and values of every layer for `batch` rows and up to `max_len` positions.

    `key_mask` records which slots hold real tokens, so rows of different prompt lengths
    (left padding) and finished rows (right padding) share one cache.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_heads: int = 0) -> None:
        """`kv_heads`: the heads this rank stores (under tensor parallelism its share); 0:
        the config's. Latent attention keeps its latents and rotary keys (`cache_dims`)."""
        (kh, kd), (vh, vd) = cfg.cache_dims
        self.k = [torch.zeros((batch, kv_heads or kh, max_len, kd), dtype=dtype, device=device)
                  for _ in range(cfg.num_layers)]
        self.v = [torch.zeros((batch, kv_heads or vh, max_len, vd), dtype=dtype, device=device)
                  for _ in range(cfg.num_layers)]
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len

    def append_mask(self, new_mask: torch.Tensor) -> None:
        end = self.length + new_mask.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, {end} requested")
        self.key_mask[:, self.length:end] = new_mask

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, kv_heads, new, hd]; return all keys and values so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n
