"""The generation engine's KV cache: one sequence per slot, left-aligned, growing in chunks."""
from __future__ import annotations

import torch

from rlloom.models.transformer import CausalLM, kv_dtype


def kv_bytes_per_slot(model: CausalLM, max_len: int) -> int:
    """Bytes of keys and values one slot holds for `max_len` positions (a capacity step
    holds one layer's old and new buffers together beside the rest: `SlotKVCache.ensure`)."""
    c = model.config
    elem = torch.empty((), dtype=kv_dtype(model)).element_size()
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * max_len * elem


class SlotKVCache:
    """Keys and values [slots, kv_heads, capacity, head_dim] per layer, one sequence per slot,
    left-aligned: slot i holds its sequence at positions [0, length_i).

    The capacity grows in steps of `chunk` positions (reallocating), instead of being sized
    for the longest possible sequence up front, so that decode attention can read a
    contiguous [rows * kv_heads, capacity, head_dim] block: a strided window of a larger
    buffer makes CPU batched matmuls copy it, about twice as slow.
    """

    def __init__(self, model: CausalLM, slots: int, max_len: int, chunk: int) -> None:
        c = model.config
        p = next(model.parameters())
        self.slots, self.kv_heads, self.head_dim = slots, c.num_kv_heads, c.head_dim
        self.layers, self.dtype, self.device = c.num_layers, kv_dtype(model), p.device
        self.max_len, self.chunk, self.cap = max_len, chunk, 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(1)

    def ensure(self, width: int) -> None:
        """Make room for positions [0, width)."""
        if width <= self.cap:
            return
        cap = min(self.max_len, -(-width // self.chunk) * self.chunk)
        shape = (self.slots, self.kv_heads, cap, self.head_dim)
        # zeros, not garbage: a NaN in an unused position would leak through 0 * NaN in P @ V
        if not self.cap:
            self.k, self.v = ([torch.zeros(shape, dtype=self.dtype, device=self.device)
                               for _ in range(self.layers)] for _ in range(2))
        else:
            # one buffer at a time, each old one freed as its copy replaces it: growing holds
            # one layer's keys (or values) twice, not the whole cache (2x the KV budget)
            for bufs in (self.k, self.v):
                for i in range(self.layers):
                    new = torch.empty(shape, dtype=self.dtype, device=self.device)
                    new[:, :, :self.cap] = bufs[i]
                    new[:, :, self.cap:] = 0
                    bufs[i] = new
        self.cap = cap

    def place(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Copy prefilled keys/values [n, kv_heads, width, hd] per layer into `slots` [n]."""
        width = k[0].shape[2]
        self.ensure(width)
        for layer, (kl, vl) in enumerate(zip(k, v)):  # autocast may hand lower precision
            self.k[layer][slots, :, :width] = kl.to(self.dtype)
            self.v[layer][slots, :, :width] = vl.to(self.dtype)

    def compact(self, keep: torch.Tensor) -> None:
        """Move slots `keep` [m] to the front."""
        m = keep.shape[0]
        for kl, vl in zip(self.k, self.v):
            kl[:m] = kl[keep]
            vl[:m] = vl[keep]
