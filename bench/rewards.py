"""Throughput of the reward functions on this machine: ``python bench/rewards.py``.

Prints programs per second through the sandbox pool and math-verify checks per second.
"""

from __future__ import annotations

import time

from rlloom.rewards.math import answers_equal
from rlloom.rewards.sandbox import SandboxPool

_WORKERS = 2
_PROGRAM = "def add(a, b):\n    return a + b\n"
_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


def bench_sandbox(n: int, workers: int = _WORKERS) -> float:
    """Returns programs per second for ``n`` small correct programs through a SandboxPool."""
    with SandboxPool(workers=workers) as pool:
        start = time.perf_counter()
        results = pool.map([(_PROGRAM, _TESTS)] * n)
        elapsed = time.perf_counter() - start
    # A failing run would be a broken sandbox, and would make the rate meaningless.
    assert all(r.fraction == 1.0 for r in results), results
    print(f"sandbox: {n} programs in {elapsed:.2f} s = {n / elapsed:.1f} programs/s "
          f"(workers={workers})")
    return n / elapsed


# A mix of what rollouts produce: integers, LaTeX fractions, sets, intervals, misses. ``{k}``
# makes every pair new, so math-verify's parse caches do not flatter the rate.
_PAIRS = [
    ("{k}", "{k}"),
    ("\\frac{{1}}{{{k}}}", "1/{k}"),
    ("\\sqrt{{{k}}}/2", "\\frac{{\\sqrt{{{k}}}}}{{2}}"),
    ("\\{{{k},1\\}}", "\\{{1,{k}\\}}"),
    ("[0,{k})", "(0,{k})"),
    ("{k},000", "{k}000"),
    ("-{k}", "{k}"),
    ("x^2+{k}x", "x(x+{k})"),
]


def bench_math(n: int) -> float:
    """Checks per second over ``n`` calls to ``answers_equal`` cycling through ``_PAIRS``."""
    answers_equal("1", "1")  # imports and regex compilation are not per-check costs
    start = time.perf_counter()
    for i in range(n):
        predicted, reference = _PAIRS[i % len(_PAIRS)]
        k = i // len(_PAIRS) + 2
        answers_equal(predicted.format(k=k), reference.format(k=k))
    return n / (time.perf_counter() - start)


def main() -> None:
    bench_sandbox(200)
    rate = bench_math(400)
    print(f"math-verify: 400 checks in {400 / rate:.2f} s = {rate:.0f} checks/s")


if __name__ == "__main__":
    main()
