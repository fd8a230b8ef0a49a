"""The end-of-run PNG: reward and accuracy per step, and where the step time went."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGES = [("gen_s", "generation"), ("assess_s", "assessment"), ("train_s", "training")]


def plot_run(rows: list[dict[str, Any]], path: Path) -> None:
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["reward"] for r in rows], label="reward (sampled)")
    ax1.plot(steps, [r["accuracy"] for r in rows], label="accuracy (sampled)")
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    if evals:
        ax1.plot(*zip(*evals), "o-", label="held-out greedy accuracy")
    ax1.set_xlabel("step")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.set_title("learning")
    bottom = [0.0] * len(rows)
    for key, label in STAGES:
        vals = [r[key] for r in rows]
        ax2.bar(steps, vals, bottom=bottom, label=label, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.legend()
    ax2.set_title("step time by stage")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
