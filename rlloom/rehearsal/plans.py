"""`rlloom plan --rehearse N`: the planner's top plans checked by rehearsal. Each plan's actor
training micro-batch runs at its real shapes and world size (`rehearse_training`), and what
its training group holds while it trains is repriced with the rehearsal's measured peak in
place of the model's."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import Priced
from rlloom.perf.model.hardware import GIB, Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.rehearsal.compare import predicted_training
from rlloom.rehearsal.train import rehearse_training


@dataclass(frozen=True)
class Rehearsal:
    """One plan's check: its actor's training peak per rank, priced and rehearsed, and what
    its training group holds while it trains, with the rehearsed bytes (GiB per device),
    for a micro-batch of
    `rows` x (`prompt` + `response`) tokens."""
    priced: Priced
    model_gib: float
    rehearsed_gib: float
    group_gib: float
    rows: int
    prompt: int
    response: int

    def fits(self, hw: Hardware) -> bool:
        return self.group_gib <= hw.mem_gib * mem.USABLE


def rehearse_plan(p: Priced, shape: ModelShape) -> Rehearsal:
    """The actor's training micro-batch at the plan's rows and longest context."""
    x, wl = p.plan.layout("actor"), p.workload
    # the update itself: a proximal or old-log-prob forward is priced as a training stage too
    group, stage = next((g, st) for st, g in zip(p.stages, p.stage_groups)
                        if st.stage == "training" and st.role == "actor" and not st.note)
    # what the group holds while the actor trains (generation's KV cache takes what is left
    # by design, so the group's overall peak is not the one to raise)
    training = p.resident_gib[group] + stage.transient_bytes / GIB
    response = math.ceil(wl.max_context - wl.prompt_len)
    args = (shape, x, p.micro_batch, wl.prompt_len, response, wl.lora_rank)
    model = predicted_training(*args)["peak"]
    measured = rehearse_training(*args).peak
    return Rehearsal(p, model / GIB, measured / GIB, training + (measured - model) / GIB,
                     *args[2:5])


def plan_checker(n: int, shape: ModelShape, hw: Hardware,
                 advance: Callable[[], None] = lambda: None
                 ) -> Callable[[list[Priced]], tuple[list[Priced], list[str], dict[int, str]]]:
    """For `perf.search.report.plan_report`: rehearse the first `n` ranked plans, drop those
    whose rehearsed peak does not fit the device, and say so; the plan-file note of each kept
    rehearsed plan (by `id`)."""
    def check(ranked: list[Priced]) -> tuple[list[Priced], list[str], dict[int, str]]:
        done = []
        for p in ranked[:n]:
            done.append(rehearse_plan(p, shape))
            advance()
        usable = hw.mem_gib * mem.USABLE
        lines = [f"rehearsed the first {len(done)} plans (actor training, the busiest rank; GiB "
                 f"per device, {usable:.1f} usable):",
                 f"{'model':>8} {'rehearsed':>9} {'group peak':>10}  plan"]
        notes: dict[int, str] = {}
        for r in done:
            verdict = "" if r.fits(hw) else "  DROPPED: does not fit"
            lines.append(f"{r.model_gib:8.2f} {r.rehearsed_gib:9.2f} {r.group_gib:10.2f}  "
                         f"{_brief(r.priced)}{verdict}")
            if r.fits(hw):
                notes[id(r.priced)] = (f"rehearsed: actor training peak {r.rehearsed_gib:.2f} "
                                       f"GiB per device (priced {r.model_gib:.2f}) for "
                                       f"{r.rows} rows of {r.prompt} + {r.response} tokens, "
                                       f"training group peak {r.group_gib:.2f} GiB")
        dropped = {id(r.priced) for r in done if not r.fits(hw)}
        kept = [p for p in ranked if id(p) not in dropped]
        if kept and id(kept[0]) not in notes:
            lines.append(f"the first plan kept is not rehearsed: rehearse more plans "
                         f"(--rehearse {min(2 * n, len(ranked))})")
        return kept, lines, notes
    return check


def _brief(p: Priced) -> str:
    x = p.plan.layout("actor")
    return (f"actor dp={x.dp} tp={x.tp}{f' ep={x.ep}' if x.ep > 1 else ''} zero={x.zero}"
            f"{' ckpt' if x.activation_checkpointing else ''}, {p.micro_batch} rows per "
            f"micro-batch")
