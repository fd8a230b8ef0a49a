"""Versioned weight synchronisation from the trainer to the copies that generate (and assess).

A `DoubleBuffer` holds two slots of named tensors, each stamped with the weight version it
holds. One publisher writes a new version into the slot that is not the latest, waiting until
no reader still holds it, then flips `latest` under a lock; readers take the latest slot for
the length of one request. So a reader never sees a slot while it is written (it only ever
acquires the latest, complete one), and it switches versions only between requests.

`ShadowModel` is the double buffer over two copies of a model (its slots are the copies'
own parameter tensors, so publishing writes straight into the weights that generate, with no
further copy). Asynchronous schedules need the second copy: generation keeps reading one
version while the trainer's next one arrives.

Moving idle roles' weights or optimizer state to host memory would be a no-op here: on CPU
the weights already live in host memory, so nothing is offloaded.
"""
from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from rlloom.models.lora import has_lora, trained_state
from rlloom.parallel.pipeline import PipelinedModel


class SyncTimeout(TimeoutError):
    pass


@dataclass
class SyncStats:
    version: int
    bytes: int        # bytes written into the buffer
    seconds: float    # waiting for readers to let go of the slot plus writing it
    wait_s: float     # of which waiting


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of distinct storages (tied weights, e.g. embedding and LM head, count once); of a
    sharded tensor, this rank's shard."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors.values()]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    return sum(seen.values())


class DoubleBuffer:
    """Two versioned slots of named tensors: one publisher, any number of readers."""

    def __init__(self, slots: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                 version: int = 0) -> None:
        if slots[0].keys() != slots[1].keys():
            raise ValueError("the two slots must hold the same tensor names")
        self._slots = slots
        self._versions = [version, version]  # slot 1 starts as a copy of slot 0 (or unused)
        self._readers = [0, 0]
        self._latest = 0
        self._cond = threading.Condition()
        self._publishing = threading.Lock()  # one publisher at a time

    @property
    def version(self) -> int:
        """The newest complete version."""
        with self._cond:
            return self._versions[self._latest]

    @contextmanager
    def read(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """The latest complete slot, held (not overwritten) until the block ends."""
        with self._cond:
            i = self._latest
            self._readers[i] += 1
            version = self._versions[i]
        try:
            yield version, self._slots[i]
        finally:
            with self._cond:
                self._readers[i] -= 1
                self._cond.notify_all()

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor],
                timeout_s: float | None = None) -> SyncStats:
        """Write `tensors` as `version` into the free slot and make it the latest."""
        with self._publishing:
            t0 = time.perf_counter()
            with self._cond:
                back = 1 - self._latest
                # a reader that took this slot before the last flip may still be using it
                if not self._cond.wait_for(lambda: self._readers[back] == 0, timeout_s):
                    raise SyncTimeout(f"a reader held weight version {self._versions[back]} "
                                      f"for more than {timeout_s}s; version {version} not "
                                      "published")
                self._versions[back] = -1  # being written: readers never take the back slot
            waited = time.perf_counter() - t0
            slot = self._slots[back]
            missing = slot.keys() - tensors.keys()
            if missing:
                raise KeyError(f"published weights lack {sorted(missing)[:3]}")
            with torch.no_grad():
                for name, dst in slot.items():
                    _write(dst, tensors[name])
            with self._cond:
                self._versions[back] = version
                self._latest = back
                self._cond.notify_all()
            return SyncStats(version, tensor_bytes(slot), time.perf_counter() - t0, waited)


def _write(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy whole weights into a slot tensor; a sharded one (a DTensor of a TP or ZeRO-3 copy)
    takes its own slice, cut locally: a publisher runs beside the reader's stage, so it must
    not issue collectives on the group's process group."""
    if isinstance(dst, DTensor):
        dst.to_local().copy_(distribute_tensor(full.to(dst.device), dst.device_mesh,
                                               dst.placements, src_data_rank=None).to_local())
    else:
        dst.copy_(full)


def synced_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The entries of `model`'s state dict that weight sync refreshes: all of them, or a LoRA
    model's trained ones."""
    state = model.state_dict()
    return trained_state(state) if has_lora(model) else state


class ShadowModel:
    """Two copies of a model behind a DoubleBuffer; `read()` lends the newest complete one.
    `twin` is the second copy when it cannot be deep-copied from the first (a sharded model
    is built twice instead). A copy may be this rank's pipeline stage of the model: its
    slots hold the stage's tensors, and `whole` names (with shapes and dtypes) every tensor
    of the model a publish is taken from."""

    def __init__(self, model: torch.nn.Module | PipelinedModel, version: int = 0,
                 twin: torch.nn.Module | PipelinedModel | None = None,
                 whole: Mapping[str, torch.Tensor] | None = None) -> None:
        self.models = (model, twin if twin is not None else copy.deepcopy(model))
        held = [m.module if isinstance(m, PipelinedModel) else m for m in self.models]
        for m in held:
            m.eval().requires_grad_(False)
        # state_dict() tensors share storage with the parameters and buffers; a LoRA model's
        # slots hold only its adapters (the base weights never change)
        self.buffer = DoubleBuffer(tuple(synced_state(m) for m in held), version)
        self._index = {id(sd): i for i, sd in enumerate(self.buffer._slots)}
        self._whole = whole

    @property
    def version(self) -> int:
        return self.buffer.version

    @property
    def synced(self) -> Mapping[str, torch.Tensor]:
        """The tensors a publish is taken from (names, shapes and dtypes of what to
        receive)."""
        return self._whole if self._whole is not None else self.buffer._slots[0]

    @contextmanager
    def read(self) -> Iterator[tuple[int, torch.nn.Module | PipelinedModel]]:
        with self.buffer.read() as (version, slot):
            yield version, self.models[self._index[id(slot)]]

    def publish(self, version: int, state: Mapping[str, torch.Tensor],
                timeout_s: float | None = None) -> SyncStats:
        return self.buffer.publish(version, state, timeout_s)
