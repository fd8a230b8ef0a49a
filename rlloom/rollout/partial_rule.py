"""The step rule of partial rollouts, shared by the runtime's pool (rollout/partial.py) and the
cost model's replay of it (perf/model/partial_pool.py), so what is priced is what runs.
Torch-free."""
from __future__ import annotations

from collections.abc import Callable


def partial_step(n: int, complete: Callable[[], int], admit: Callable[[int], None],
                 decode_chunk: Callable[[], None]) -> None:
    """Fill a step's n groups: admit n new prompt groups, and as many more as the complete
    groups waiting fall short of n (so the pool grows until one chunk a step completes about
    n groups), decode one chunk of every pending row; while fewer than n groups are complete,
    admit the shortfall and decode another chunk."""
    more = n + max(0, n - complete())
    while more > 0:
        admit(more)
        decode_chunk()
        more = n - complete()
