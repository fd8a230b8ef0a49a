"""The end-of-run PNG: reward and accuracy per step, and where the step time went."""
from __future__ import annotations

from pathlib import Path
from typing import Any

CURVES = [("reward", "reward (sampled)"), ("accuracy", "accuracy (sampled)"),
          ("pref_accuracy", "preference accuracy")]
STAGES = [("gen_s", "generation"), ("assess_s", "assessment"), ("train_s", "training")]


def plot_run(rows: list[dict[str, Any]], evals: list[tuple[int, float]], path: Path) -> None:
    """`rows` are metrics.jsonl rows; `evals` are (step, held-out accuracy), step 0 included."""
    if not rows:
        return
    # imported here: every rank and Ray driver imports the step loop, one of them plots (0.4 s
    # of start-up each otherwise)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    for key, label in CURVES:
        if key in rows[0]:
            ax1.plot(steps, [r[key] for r in rows], label=label)
    if evals:
        ax1.plot(*zip(*evals), "o-", label="held-out greedy accuracy")
    ax1.set_xlabel("step")
    ax1.set_ylim(-0.02, 1.02)
    ax1.legend()
    ax1.set_title("learning")
    if "response_len" in rows[0]:
        ax3.plot(steps, [r["response_len"] for r in rows])
        ax3.set_ylabel("tokens")
        ax3.set_title("mean response length")
    else:
        ax3.plot(steps, [r["loss"] for r in rows])
        ax3.set_title("loss")
    ax3.set_xlabel("step")
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
