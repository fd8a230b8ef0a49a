"""The generation engine's KV cache: one sequence per slot, left-aligned, growing in chunks."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rlloom.models.transformer import CausalLM, kv_dtype, local_kv_heads
from rlloom.perf.model.memory import (
    PREFILL_TOKENS,
    generation_slots,
    generation_transient_bytes,
)
from rlloom.perf.model.shapes import ModelShape

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed support has no DTensor parameters
    DTensor = ()


def kv_bytes_per_slot(model: CausalLM, max_len: int) -> int:
    """Bytes of keys and values one slot (or one row of the plain loop's cache) holds on this
    rank for `max_len` positions (a capacity step holds one layer's old and new buffers
    together beside the rest: `SlotKVCache.ensure`)."""
    c = model.config
    elem = torch.empty((), dtype=kv_dtype(model)).element_size()
    (_, kd), (_, vd) = c.cache_dims
    return c.num_layers * local_kv_heads(model) * (kd + vd) * max_len * elem


def kv_slots(model: CausalLM, rows: int, prompt: int, max_len: int, max_batch: int,
             budget: int, plain: bool, prefill_tokens: int = PREFILL_TOKENS,
             routes: bool = False) -> int:
    """Sequences of up to `max_len` positions (prompts up to `prompt`) decoded at once: all
    `rows`, at most `max_batch` (0: no cap), and as many as `budget` bytes hold (0: no cap)
    with their KV cache and the forwards' working memory (`perf.model.memory.
    generation_slots`, which prices the same; `plain`: the plain loop's waves; `routes`:
    routing replay's record is kept too)."""
    slots = min(rows, max_batch or rows)
    if budget:
        per_slot = kv_bytes_per_slot(model, max_len)
        shape = ModelShape.from_hf_config(model.config.to_hf())
        tp = model.config.cache_dims[0][0] // local_kv_heads(model)
        room = max_len - prompt
        fit = generation_slots(shape, tp, budget, per_slot, prompt, plain, rows, room,
                               prefill_tokens, routes)
        if fit < 1:
            need = per_slot + generation_transient_bytes(shape, tp, 1, prompt, 1, plain, rows,
                                                         room, prefill_tokens, routes)
            raise ValueError(f"one sequence of {max_len} positions needs {need / 2**30:.2f} GiB "
                             f"(its KV cache and the forwards' working memory), the device has "
                             f"{budget / 2**30:.2f} GiB left for generation: shorten "
                             "rollout.max_new_tokens or the prompts, or shard the model wider "
                             "(tp)")
        slots = min(slots, fit)
    return slots


def agreed(model: nn.Module, rows: int) -> int:
    """The fewest `rows` of any rank sharing `model`'s sharded parameters: their budgets come
    from each rank's free memory, and ranks that split a batch differently would wait on each
    other's collectives forever."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None:
        return rows
    t = torch.tensor([rows], device=mesh.device_type)
    for group in mesh.get_all_groups():
        dist.all_reduce(t, dist.ReduceOp.MIN, group=group)
    return int(t)


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

    def place(self, slots: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
              rows: torch.Tensor) -> None:
        """Copy rows `rows` [n] of prefilled keys/values [g, kv_heads, width, hd] per layer into
        `slots` [n], a layer at a time (selecting every layer's rows first would hold a second
        copy of the prompts' whole cache)."""
        width = k[0].shape[2]
        self.ensure(width)
        for layer, (kl, vl) in enumerate(zip(k, v)):  # autocast may hand lower precision
            self.k[layer][slots, :, :width] = kl[rows].to(self.dtype)
            self.v[layer][slots, :, :width] = vl[rows].to(self.dtype)

    def compact(self, keep: torch.Tensor) -> None:
        """Move slots `keep` [m] to the front."""
        m = keep.shape[0]
        for kl, vl in zip(self.k, self.v):
            kl[:m] = kl[keep]
            vl[:m] = vl[keep]
