"""The weight channel: a gloo process group of its own (not the members' worlds) over which
the sender's whole weights reach every member exactly, and a member expecting other tensors
fails on every rank with the cause instead of hanging."""
import multiprocessing as mp
import socket

import pytest
import torch

from rlloom.runtime.executor import weight_channel
from rlloom.runtime.executor.weight_channel import ChannelMismatch, WeightChannel


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(7, 5, generator=g),
            "a.weight": torch.randn(300, generator=g, dtype=torch.float64),
            "c.bias": torch.randn(3, generator=g),
            "d.count": torch.arange(4)}


def _member(address, rank, world, expect, bucket_bytes):
    weight_channel.BUCKET_BYTES = bucket_bytes
    channel = WeightChannel(address, rank, world, torch.device("cpu"), timeout_s=60)
    try:
        if rank == 0:
            return "sent", channel.send(_weights())
        got, nbytes = channel.receive({k: torch.empty_like(v) for k, v in expect.items()})
        return "received", nbytes, {k: v.clone() for k, v in got.items()}
    except ChannelMismatch as e:
        return "mismatch", str(e)


def _run(expected: list[dict], bucket_bytes: int = 1 << 20) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    world = len(expected) + 1
    args = [(address, r, world, expected[r - 1] if r else {}, bucket_bytes)
            for r in range(world)]
    with mp.get_context("forkserver").Pool(world) as pool:  # conftest.py preloads
        return pool.starmap(_member, args, chunksize=1)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])  # one bucket per dtype run, or many
def test_every_member_receives_the_senders_weights_exactly(bucket_bytes):
    sent = _weights()
    results = _run([sent, sent], bucket_bytes)
    nbytes = sum(v.numel() * v.element_size() for v in sent.values())
    assert results[0] == ("sent", nbytes)
    for kind, got_bytes, got in results[1:]:
        assert kind == "received" and got_bytes == nbytes
        assert got.keys() == sent.keys()
        for k, v in sent.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_a_member_expecting_other_weights_fails_everywhere_without_hanging():
    other = dict(_weights())
    other["b.weight"] = torch.empty(5, 7)  # same bytes, another shape
    results = _run([_weights(), other])
    assert [r[0] for r in results] == ["mismatch"] * 3
    assert "names, shapes or dtypes differ" in results[0][1]
