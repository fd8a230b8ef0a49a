"""Throughput of the reward functions on this machine: ``python bench/rewards.py``.

Prints programs per second of the code judge (judge process + one isolated box per program,
``rlloom/rewards/sandbox.py``) against the same judge as it was at ``PREVIOUS`` (before the
system-call filter, the smaller set of files a box sees, the warmed page cache and the
bounded decoding; taken from git), measured in alternating rounds in one run, and
math-verify checks per second.
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlloom.rewards.math import answers_equal
from rlloom.rewards.sandbox import SandboxPool

_WORKERS = 2
_ROUNDS = 3
_PROGRAM = "def add(a, b):\n    return a + b\n"
_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]
PREVIOUS = "f2a7e40"  # the last commit before the box's system-call filter
_MODULES = ("sandbox", "judge", "box", "box_server", "cgroups")
_REPO = Path(__file__).resolve().parents[1]


def previous_pool_class() -> type:
    """The SandboxPool of ``PREVIOUS``, loaded from git into a temporary package (its judge
    runs as ``python -m old_sandbox.judge``)."""
    root = Path(tempfile.mkdtemp(prefix="rlloom-old-sandbox-"))
    package = root / "old_sandbox"
    package.mkdir()
    for name in _MODULES:
        text = subprocess.run(["git", "show", f"{PREVIOUS}:rlloom/rewards/{name}.py"],
                              cwd=_REPO, check=True, capture_output=True, text=True).stdout
        text = text.replace("rlloom.rewards.", "old_sandbox.").replace(
            "from rlloom.rewards import", "from old_sandbox import").replace(
            "Path(__file__).resolve().parents[2]", "Path(__file__).resolve().parents[1]")
        (package / f"{name}.py").write_text(text)
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(root))
    return importlib.import_module("old_sandbox.sandbox").SandboxPool


def rate(pool: object, n: int) -> float:
    """Programs per second for ``n`` small correct programs through ``pool``."""
    start = time.perf_counter()
    results = pool.map([(_PROGRAM, _TESTS)] * n)
    elapsed = time.perf_counter() - start
    # A failing run would be a broken sandbox, and would make the rate meaningless.
    assert all(r.fraction == 1.0 for r in results), results
    return n / elapsed


def bench_sandbox(n: int) -> None:
    old_pool_class = previous_pool_class()
    rates: dict[str, list[float]] = {"judge + box (now)": [], f"judge + box ({PREVIOUS})": []}
    with SandboxPool(workers=_WORKERS) as new, old_pool_class(workers=_WORKERS) as old:
        for pool in (new, old):
            pool.map([(_PROGRAM, _TESTS)] * 4)  # start the judges / warm the caches
        for _ in range(_ROUNDS):  # alternating, so that the host's drift hits both
            for name, pool in zip(rates, (new, old)):
                rates[name].append(rate(pool, n))
    for name, values in rates.items():
        print(f"sandbox {name:<26} {statistics.median(values):6.1f} programs/s "
              f"(rounds: {', '.join(f'{v:.1f}' for v in values)}; {n} programs, "
              f"workers={_WORKERS})")
    new_rate, old_rate = (statistics.median(v) for v in rates.values())
    print(f"ratio now/previous: {new_rate / old_rate:.2f}x (target >= 0.8x)")


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
    rate_ = bench_math(400)
    print(f"math-verify: 400 checks in {400 / rate_:.2f} s = {rate_:.0f} checks/s")


if __name__ == "__main__":
    main()
