"""The partial-rollout pool (rollout/partial.py) replayed on response lengths alone: which rows
each chunk call decodes, how far, and from how much context, step after step.

The replay runs the runtime's own step rule (`rollout.partial_rule.partial_step`); then the B
oldest complete groups leave, as they do from the runtime's pool.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

from rlloom.rollout.partial_rule import partial_step


@dataclass(frozen=True)
class ChunkCall:
    """One engine call over the pool's pending rows: per row its group, the tokens it held
    before the call and the tokens it generates in it."""
    groups: tuple[int, ...]
    done: tuple[int, ...]
    new: tuple[int, ...]


def pool_steps(lengths: list[int], prompts: int, samples: int, chunk: int, steps: int
               ) -> list[list[ChunkCall]]:
    """The chunk calls of each of `steps` steps, rows drawing their full response lengths
    from `lengths` in order (cycled through reshuffled copies when the replay needs more)."""
    stream = _lengths(lengths)
    rows: list[list[int]] = []  # [group, full length, done]
    groups = itertools.count()
    out: list[list[ChunkCall]] = []

    def admit(more: int) -> None:
        for g in itertools.islice(groups, more):
            rows.extend([g, next(stream), 0] for _ in range(samples))

    def decode_chunk() -> None:
        pending = [r for r in rows if r[2] < r[1]]
        out[-1].append(ChunkCall(tuple(r[0] for r in pending), tuple(r[2] for r in pending),
                                 tuple(min(chunk, r[1] - r[2]) for r in pending)))
        for r in pending:
            r[2] += min(chunk, r[1] - r[2])

    for _ in range(steps):
        out.append([])
        partial_step(prompts, lambda: len(_complete(rows)), admit, decode_chunk)
        taken = set(_complete(rows)[:prompts])
        rows[:] = [r for r in rows if r[0] not in taken]
    return out


def _complete(rows: list[list[int]]) -> list[int]:
    open_groups = {r[0] for r in rows if r[2] < r[1]}
    return sorted({r[0] for r in rows} - open_groups)


def _lengths(lengths: list[int]) -> Iterator[int]:
    order = list(lengths)
    rng = random.Random(0)
    while True:
        rng.shuffle(order)
        yield from order
