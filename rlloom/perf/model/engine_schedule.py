"""The generation engine's schedule for one replica (`rollout/engine.py` replayed on lengths):
continuous batching over KV slots, prefix-shared admission per prompt group, and tool calls
that park a slot. `cost.generation` prices what it returns; tests check it against the
engine's own counts."""
from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from rlloom.perf.model.workload import Lengths, Workload


@dataclass(frozen=True)
class EngineSchedule:
    """What the engine runs for one replica: `segments` of (decode steps, live rollouts,
    their generated tokens summed at the segment's start, the longest of them at its start:
    every row's attention reads that many keys past the prompt), the prompts each prefill forward
    of an admission takes, the tokens of each extend forward (a tool call's last token and
    its result, appended to a parked rollout), and the steps' worth of time the replica
    spends idle, every held slot waiting on a tool."""
    segments: tuple[tuple[int, int, int, int], ...]
    prefills: tuple[int, ...]
    extends: tuple[int, ...] = ()
    idle_steps: int = 0

    @property
    def decode_steps(self) -> int:
        return sum(steps for steps, *_ in self.segments)

    @property
    def rollout_steps(self) -> int:
        """Live rollouts summed over the decode steps."""
        return sum(steps * live for steps, live, *_ in self.segments)


# a turn of a rollout: (tokens it samples, tokens its tool call's result inserts, steps' worth
# of time the call takes); a single-turn rollout is one (length, 0, 0)
Turn = tuple[int, int, int]


def engine_schedule(lengths: Sequence[int], slots: int, samples: int,
                    groups: list[int] | None = None, done: list[int] | None = None,
                    turns: list[list[Turn]] | None = None) -> EngineSchedule:
    """The decode steps and prefills of rollouts with response `lengths` (tokens, in queue
    order; each run of `samples` shares a prompt, or rows of equal `groups` entries do) over
    `slots` KV slots with continuous batching, as the engine runs them: admitted rollouts take
    their first token from the prefill's logits; one decode step gives every live rollout a
    token; the slots freed by rollouts that end are refilled before the next step, a rollout
    of one token freeing its slot at once (another prefill forward). `done`: tokens a
    (partial) rollout already holds in its context before this call. `turns` (multi-turn
    rollouts, overriding `lengths`): a turn but the last ends in a tool call; its rollout
    stays in its slot, parked, not decoding, until the call returns; then one extend forward
    appends the result and gives the next turn's first token."""
    plans = turns or [[(length, 0, 0)] for length in lengths]
    n = len(plans)
    group = groups or [i // samples for i in range(n)]
    held = done or [0] * n
    step = waiting = generated = live = idle = 0
    free = slots
    # (step, kind, rollout, turn, context growth then): a turn's end in a decode step (0), a
    # tool call's return (1); at one step the engine retires and parks the ended turns,
    # admits, and then extends the returned calls
    events: list[tuple[int, int, int, int, int]] = []
    prefilled: set[int] = set()
    segments: list[tuple[int, int, int, int]] = []
    prefills: list[int] = []
    extends: list[int] = []
    # live turns by context at step 0 (their context at step t is that plus t), longest first;
    # an ended turn leaves its entry, skipped when it comes to the top
    longest: list[tuple[int, int, int]] = []
    ended: set[tuple[int, int]] = set()

    def begin(i: int, j: int, growth: int) -> None:
        """Turn j of rollout i starts, its first token sampled (from a prefill's or an
        extend's logits): `growth` tokens past the prompt in its context."""
        nonlocal generated, live
        sampled = max(1, plans[i][j][0])
        if sampled == 1:  # ended on that token, before any decode step
            end(i, j, growth, at_once=True)
            return
        live += 1
        generated += growth
        heapq.heappush(longest, (step - growth, i, j))
        heapq.heappush(events, (step + sampled - 1, 0, i, j, growth + sampled - 1))

    def end(i: int, j: int, growth: int, at_once: bool) -> None:
        """Turn j ends: the rollout frees its slot, or parks until its call returns (a call
        that has returned already is extended at once when its turn ended at once)."""
        nonlocal free
        if j + 1 == len(plans[i]):
            free += 1
        elif at_once and plans[i][j][2] == 0:
            resume(i, j, growth)
        else:
            heapq.heappush(events, (step + plans[i][j][2], 1, i, j, growth))

    def resume(i: int, j: int, growth: int) -> None:
        result = plans[i][j][1]
        extends.append(1 + result)
        begin(i, j + 1, growth + result + 1)

    while True:
        while events and events[0][:2] <= (step, 0):
            _, _, i, j, growth = heapq.heappop(events)
            live -= 1
            generated -= growth
            ended.add((i, j))
            end(i, j, growth, at_once=False)
        while free and waiting < n:  # admission: one prefill forward per round
            new = range(waiting, min(n, waiting + free))
            waiting, free = new.stop, free - len(new)
            fresh = {group[i] for i in new} - prefilled
            if fresh:
                prefills.append(len(fresh))
                prefilled |= fresh
            for i in new:
                begin(i, 0, 1 + held[i])
        resumed = False
        while events and events[0][0] <= step:
            _, _, i, j, growth = heapq.heappop(events)
            resume(i, j, growth)
            resumed = True
        if resumed and free and waiting < n:
            continue  # a resumed rollout ended at once: its slot is refilled first
        if not events:
            return EngineSchedule(tuple(segments), tuple(prefills), tuple(extends), idle)
        steps = events[0][0] - step
        if live:
            while (longest[0][1], longest[0][2]) in ended:
                heapq.heappop(longest)
            segments.append((steps, live, generated, step - longest[0][0]))
            generated += steps * live
        else:
            idle += steps
        step += steps


def static_schedule(lengths: Sequence[int], slots: int) -> EngineSchedule:
    """What the engine runs for a sharded model (`rollout.engine.Engine` over tensor
    parallelism): the plain loop, on waves of `slots` rollouts in queue order, each one
    prefill forward of its own prompts (no prefix sharing) and then decode steps over every
    row of the wave until its longest ends."""
    waves = [lengths[i:i + slots] for i in range(0, len(lengths), slots)]
    return EngineSchedule(tuple((max(w) - 1, len(w), len(w), 1) for w in waves if max(w) > 1),
                          tuple(len(w) for w in waves))


def queue_lengths(wl: Workload, n: int) -> tuple[int, ...]:
    """The slowest replica's `n` response lengths, in a fixed shuffled queue order (lengths do
    not follow the order prompts arrive in): spread quantiles whose longest is the whole
    batch's longest (its top quantile of `wl.rollouts`), since the step waits for the
    replica that draws it, however many replicas share the batch or rollouts one simulated
    length stands for."""
    return _queue(wl.response, wl.rollouts, n)


@functools.lru_cache(maxsize=1024)  # the planner prices the same lengths for every layout
def _queue(response: Lengths, rollouts: int, n: int) -> tuple[int, ...]:
    lengths = [max(1, round(x)) for x in response.spread(n)]
    top = response.quantile(1 - 0.5 / max(rollouts, n))
    lengths[-1] = max(lengths[-1], round(top))
    random.Random(0).shuffle(lengths)
    return tuple(lengths)


def turn_plans(wl: Workload, lengths: Sequence[int], step_s: float) -> list[list[Turn]]:
    """Each rollout of response `lengths` as `wl.turns` turns of equal sampled tokens, each
    but the last followed by a result of `wl.tool_result_len` tokens (fewer where the
    response is too short) and a tool latency drawn from `wl.tool_latency` (in a fixed
    shuffled order), in steps of `step_s` seconds."""
    t = wl.turns
    latencies = list(wl.tool_latency.spread(len(lengths) * (t - 1)))
    random.Random(1).shuffle(latencies)
    plans = []
    for i, length in enumerate(lengths):
        result = max(0, min(wl.tool_result_len, (length - t) // (t - 1)))
        sampled = length - (t - 1) * result
        share = [sampled // t + (j < sampled % t) for j in range(t)]
        waits = [math.ceil(x / step_s) if step_s > 0 else 0
                 for x in latencies[i * (t - 1):(i + 1) * (t - 1)]]
        plans.append([(share[j], result, waits[j]) for j in range(t - 1)] + [(share[-1], 0, 0)])
    return plans
