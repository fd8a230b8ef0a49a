"""The double buffer behind weight sync: a reader never sees a partially written version."""
import random
import threading
import time

import pytest
import torch

from rlloom.runtime.executor.weight_sync import DoubleBuffer, ShadowModel, SyncTimeout, tensor_bytes

SHAPES = {"a": (256, 256), "b": (1000,), "c": (64, 64, 4)}


def _slot():
    return {k: torch.zeros(s) for k, s in SHAPES.items()}


def _version_of(tensors):
    """The one version every element holds, or None if the slot mixes versions."""
    values = torch.cat([t.flatten() for t in tensors.values()])
    lo, hi = values.min().item(), values.max().item()
    return int(lo) if lo == hi else None


def test_concurrent_reads_never_see_mixed_versions():
    buf = DoubleBuffer((_slot(), _slot()))
    versions = 300
    stop = threading.Event()
    errors: list[str] = []
    seen: list[set[int]] = [set() for _ in range(3)]

    def publisher():
        for v in range(1, versions + 1):
            buf.publish(v, {k: torch.full(s, float(v)) for k, s in SHAPES.items()},
                        timeout_s=30)
        stop.set()

    def reader(i):
        rng = random.Random(i)
        last = 0
        while not stop.is_set():
            with buf.read() as (version, tensors):
                if rng.random() < 0.3:
                    time.sleep(rng.random() * 1e-3)  # hold the slot across publishes
                got = _version_of(tensors)
            if got != version:
                errors.append(f"reader {i}: slot stamped {version} holds {got}")
            if version < last:
                errors.append(f"reader {i}: version went back from {last} to {version}")
            last = version
            seen[i].add(version)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=publisher))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    assert buf.version == versions
    assert all(len(s) > 5 for s in seen)  # the readers really interleaved with the writes


def test_publisher_waits_for_readers_of_the_back_slot_and_times_out():
    buf = DoubleBuffer((_slot(), _slot()))
    ones = {k: torch.ones(s) for k, s in SHAPES.items()}
    with buf.read() as (version, _):
        assert version == 0
        stats = buf.publish(1, ones, timeout_s=1)  # the free slot: no wait
        assert stats.bytes == tensor_bytes(ones) and buf.version == 1
        with pytest.raises(SyncTimeout):
            buf.publish(2, ones, timeout_s=0.1)    # would overwrite the slot being read
    assert buf.publish(2, ones, timeout_s=1).version == 2


def test_shadow_model_publishes_into_the_copy_not_being_read():
    model = torch.nn.Linear(4, 4)
    shadow = ShadowModel(model)
    before = model.weight.detach().clone()
    new = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    with shadow.read() as (v0, m0):
        shadow.publish(1, new)
        assert v0 == 0 and torch.equal(m0.weight, before)  # untouched while read
    with shadow.read() as (v1, m1):
        assert v1 == 1 and m1 is not m0 and bool((m1.weight == 7).all())
