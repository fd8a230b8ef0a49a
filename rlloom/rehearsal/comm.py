"""Collectives of real code run in a fake world: each one the code issues, by kind, with the
bytes a member sends on a ring (what `perf.model.comm` prices), counted from the tensors it
was given, whatever layer of torch issued it (FSDP2's c10d calls, DTensor's functional
collectives)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# op name -> (kind, index of the argument holding the full buffer, index of its group)
_C10D = {
    "allreduce_": ("all_reduce", 0, 1),
    "_allgather_base_": ("all_gather", 0, 2),
    "allgather_": ("all_gather", 0, 2),  # into a list of tensors (lists of them, per input)
    "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "send": ("p2p", 0, None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, 2),
    "all_gather_into_tensor": ("all_gather", None, 2),  # None: the output, gathered
    "reduce_scatter_tensor": ("reduce_scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}


class Collectives(TorchDispatchMode):
    """`count[kind]` collectives issued inside, and `sent[kind]` bytes this rank sends in
    them: 2(p-1)/p of the buffer for an all-reduce, (p-1)/p of the whole buffer for an
    all-gather, reduce-scatter or all-to-all, the buffer for a broadcast or a send."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        space, name = func.namespace, func._overloadpacket.__name__
        table = _C10D if space == "c10d" else _FUNCTIONAL if space == "_c10d_functional" else {}
        if name in table:
            kind, buffer, group = table[name]
            size = _group_size(args[group]) if group is not None else 2
            whole = _bytes(args[buffer] if buffer is not None else out)
            share = {"all_reduce": 2 * (size - 1) / size, "broadcast": 1.0,
                     "p2p": 1.0}.get(kind, (size - 1) / size)
            self.count[kind] += 1
            self.sent[kind] += share * whole
        return out

    @property
    def total(self) -> float:
        return float(sum(self.sent.values()))


def _bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0]
               if isinstance(t, torch.Tensor))


def _group_size(group: Any) -> int:
    if isinstance(group, str):
        return _resolve_process_group(group).size()
    return ProcessGroup.unbox(group).size()  # the c10d ops' TorchScript handle
