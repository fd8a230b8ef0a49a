"""Peak memory of real code run on fake tensors: every storage the code allocates, live from
its creation to its last reference, as a caching allocator would hold it (less rounding and
fragmentation, which `perf.model.memory.USABLE` covers)."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """Bytes allocated inside the mode and still alive (`now`) and their high-water mark
    (`peak`). Storages made before the mode (the parameters) are not counted: the caller
    knows them."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        # storage address -> [bytes, weak reference]
        self._live: dict[int, list] = {}

    def __enter__(self) -> "PeakMemory":
        # FSDP2 gathers into, and frees, parameter storages by resizing them, outside dispatch
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            self._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (a view, an in-place op) allocated nothing
        given = {_storage(t)._cdata for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t)._cdata not in given:
                self._track(_storage(t))
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._live:
            return
        # the storage's Python object lives as long as the storage itself (PyObject
        # preservation), so its finaliser marks the free
        self._live[key] = [storage.nbytes(),
                           weakref.ref(storage, lambda _, k=key: self._free(k))]
        self._grew(storage.nbytes())

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._live.get(storage._cdata)
        if record is None:
            self._track(storage)
            return
        change, record[0] = storage.nbytes() - record[0], storage.nbytes()
        self._grew(change)

    def _grew(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        record = self._live.pop(key, None)
        if record is not None:
            self.now -= record[0]


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage `t`'s bytes live in: a DTensor's are its local shard's."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
