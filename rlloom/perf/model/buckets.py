"""How rlloom cuts a batch of sequences into length-bucketed micro-batches: the runtime's
split (runtime/stages/packing.py) and the cost model's padding estimate (workload.py) both
call this, so the model prices exactly what runs. Pure Python: the perf package must not
import torch.

Rows come sorted by length. A micro-batch is a contiguous run of them, padded to its longest
prompt plus its longest response, so it computes rows x (max prompt + max response) tokens.
Every micro-batch also costs a fixed number of operator launches, whatever its size; we price
that as `overhead` tokens. A dynamic programme picks the cuts that minimise padded tokens plus
overhead, with no micro-batch above `budget` padded tokens (the activation-memory cap) unless
it is a single row. Few long rows among many short ones get their own micro-batch instead of
making every short row pay their width.
"""
from __future__ import annotations

# One forward+backward of the built-in model launches ~300 operators (a few ms on a CPU);
# a token of it costs ~25 us, so a micro-batch's fixed cost is ~128 tokens' worth. On bigger
# models a token costs more and the overhead matters less; the cuts barely change.
MICRO_BATCH_OVERHEAD_TOKENS = 128


def split_sorted(prompt_lens: list[float], response_lens: list[float], budget: float,
                 overhead: int = MICRO_BATCH_OVERHEAD_TOKENS, prompts_done: bool = False
                 ) -> list[tuple[int, int]]:
    """[start, end) bounds of the micro-batches of rows already sorted by length.

    `prompts_done`: the prompts ran in a shared pass (runtime/stages/shared_prompt.py), so a
    micro-batch computes only its responses, but still holds its prompts' keys and values:
    they count against the budget, not in the cost."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    n = len(prompt_lens)
    best = [0.0] + [float("inf")] * n  # best[i]: cheapest split of the first i rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        p_max = r_max = 0.0
        low, at = float("inf"), 0
        # the runtime calls this every mini-batch: plain comparisons, not max(), in the loop
        for start in range(end - 1, -1, -1):
            p, r = prompt_lens[start], response_lens[start]
            if p > p_max:
                p_max = p
            if r > r_max:
                r_max = r
            rows = end - start
            if rows * (p_max + r_max) > budget and rows > 1:
                break  # widths only grow as the run extends left: no longer run fits
            padded = rows * (r_max if prompts_done else p_max + r_max)
            if padded >= low:
                break  # best[start] >= 0 and padded only grows: nothing cheaper further left
            cost = best[start] + padded
            if cost < low:
                low, at = cost, start
        best[end], cut[end] = low + overhead, at
    bounds, end = [], n
    while end > 0:
        bounds.append((cut[end], end))
        end = cut[end]
    return bounds[::-1]


def padded_tokens(prompt_lens: list[float], response_lens: list[float],
                  bounds: list[tuple[int, int]], prompts_done: bool = False) -> float:
    """Tokens the micro-batches compute, padding included."""
    return sum((e - s) * (max(response_lens[s:e]) + (0 if prompts_done else
                                                     max(prompt_lens[s:e])))
               for s, e in bounds)
