"""A Gantt chart of a simulation: one row per device group, one bar per stage."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlloom.perf.validation.simulate import Simulation  # noqa: E402

COLORS = {"generation": "tab:blue", "assessment": "tab:orange", "training": "tab:green"}


def plot_gantt(sim: Simulation, path: Path, title: str) -> None:
    groups = sorted({s.group for s in sim.spans})
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.6 * len(groups)))
    for s in sim.spans:
        stage = s.name.split()[0]
        ax.barh(groups.index(s.group), s.end - s.start, left=s.start, height=0.6,
                color=COLORS[stage], edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(groups)),
                  [f"{g} (idle {sim.idle[g]:.0%})" for g in groups])
    ax.set_xlabel("seconds")
    ax.set_title(f"{title}: steady-state step {sim.step_s:.1f} s")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()],
              labels=list(COLORS), loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
