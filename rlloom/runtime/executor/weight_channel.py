"""A process group that spans the training group's rank 0 and every rank of a group holding a
copy of its weights, and the broadcast that moves the weights over it (NCCL on GPUs, gloo on
CPUs: one code path, exercised on CPU in CI).

Each rank of a device group already belongs to its group's torch.distributed world, so a
channel is a second, separate process group built from its own TCP store (`ProcessGroupGloo`
or `ProcessGroupNCCL` constructed directly, not through `init_process_group`, which allows one
world per process). The sender is channel rank 0.

One sync: the sender broadcasts a header (how many tensors, a checksum of their names, shapes
and dtypes); every member checks it against the tensors it expects and all agree (an
all-reduce of their verdicts) before any data moves, so a mismatch fails on every rank with
its cause instead of hanging. The weights then travel as flat buckets of one dtype each, in
name order, and each receiver cuts them back into whole tensors.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# at most this many bytes per broadcast: a bucket is staged whole on sender and receivers
BUCKET_BYTES = 256 * 2**20


class ChannelMismatch(RuntimeError):
    pass


def _signature(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    text = "\n".join(f"{n}:{tuple(s)}:{d}" for n, s, d in specs)
    return zlib.crc32(text.encode())


def _buckets(specs: list[tuple[str, tuple[int, ...], torch.dtype]]
             ) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """Consecutive runs of one dtype, each at most BUCKET_BYTES (a larger tensor alone)."""
    out: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []
    size = 0
    for spec in specs:
        _, shape, dtype = spec
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not out or out[-1][0][2] != dtype or size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(spec)
        size += nbytes
    return out


class WeightChannel:
    """Rank `rank` of a channel of `world` members meeting at `address` (tcp://host:port,
    on the sender's host)."""

    def __init__(self, address: str, rank: int, world: int, device: torch.device,
                 timeout_s: float) -> None:
        url = urlparse(address)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(url.hostname, url.port, world, is_master=rank == 0,
                              timeout=timeout)
        self.rank, self.world, self.device = rank, world, device
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    def _agree(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        header = torch.tensor([len(specs), _signature(specs)], dtype=torch.int64,
                              device=self.device)
        mine = header.clone()
        self.pg.broadcast(header, 0).wait()
        bad = torch.tensor([int(not torch.equal(header, mine))], device=self.device)
        self.pg.allreduce(bad).wait()
        if bad.item():
            raise ChannelMismatch(
                f"weight sync: {int(bad.item())} member(s) of the channel expect other tensors "
                f"than the sender's {int(header[0])} (names, shapes or dtypes differ); the "
                "training and generation copies must be the same model")

    def send(self, state: Mapping[str, torch.Tensor]) -> int:
        """Broadcast whole weights (rank 0); the bytes sent to each member."""
        specs = [(n, tuple(state[n].shape), state[n].dtype) for n in sorted(state)]
        self._agree(specs)
        total = 0
        for bucket in _buckets(specs):
            flat = torch.cat([state[n].reshape(-1).to(self.device) for n, _, _ in bucket])
            self.pg.broadcast(flat, 0).wait()
            total += flat.numel() * flat.element_size()
        return total

    def receive(self, like: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """The sender's whole weights, for tensors named and shaped like `like` (a sharded
        tensor's whole shape), on this member's device; and the bytes received."""
        specs = [(n, tuple(like[n].shape), like[n].dtype) for n in sorted(like)]
        self._agree(specs)
        out: dict[str, torch.Tensor] = {}
        total = 0
        for bucket in _buckets(specs):
            sizes = [torch.Size(s).numel() for _, s, _ in bucket]
            flat = torch.empty(sum(sizes), dtype=bucket[0][2], device=self.device)
            self.pg.broadcast(flat, 0).wait()
            total += flat.numel() * flat.element_size()
            for (name, shape, _), part in zip(bucket, flat.split(sizes)):
                out[name] = part.view(shape)
        return out, total
