"""Discrete-event simulation of N steps of a priced plan with sampled response lengths.

Each step draws its own response lengths (so long tails vary step to step), prices its stages
with `compose.price`, and places every stage on its device group's timeline under the plan's
schedule: sync (barriers), fused (assessment streams behind generation), or async (generation
of step i may start once the weights of step i-1-eta are synced).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from rlloom.perf.model.compose import price
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload, step_lengths
from rlloom.plan import Layout, Plan

WARMUP_STEPS = 2  # steps excluded from the steady-state step time (pipelines still filling)


@dataclass(frozen=True)
class Span:
    group: str   # device group: "all", a role, "trainable"/"frozen", or "generation"
    name: str    # "<stage> <role>"
    step: int
    start: float
    end: float


@dataclass
class Simulation:
    spans: list[Span]
    step_s: float             # steady state: mean interval between training ends after warm-up
    idle: dict[str, float]    # group -> fraction of the makespan it sits idle
    makespan: float
    step_ends: list[float]    # when each step's training ends

    def chrome_trace(self, path: Path) -> None:
        events = [{"name": s.name, "ph": "X", "pid": s.group, "tid": s.name.split()[0],
                   "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": {"step": s.step}}
                  for s in self.spans]
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def simulate(plan: Plan, models: dict[str, ModelShape | None], wl: Workload, hw: Hardware,
             steps: int, seed: int = 0, gen_layout: Layout | None = None) -> Simulation:
    """`steps` steps of `wl`, each with its own sampled response lengths."""
    rng = random.Random(seed)
    return timeline(plan, models, [replace(wl, response=step_lengths(wl, rng))
                                   for _ in range(steps)], hw, gen_layout)


def timeline(plan: Plan, models: dict[str, ModelShape | None], workloads: list[Workload],
             hw: Hardware, gen_layout: Layout | None = None) -> Simulation:
    """One step per workload, in order, placed on the groups' timelines (module docstring);
    each stage starts the driver's round trip to its group (`Priced.call_s`) after what it
    waits for."""
    free: dict[str, float] = {}            # group -> time it becomes free
    train_end: list[float] = []
    gen_end_prev = 0.0
    spans: list[Span] = []
    for i, step_wl in enumerate(workloads):
        priced = price(plan, models, step_wl, hw, gen_layout)
        if priced.problems:
            raise ValueError(f"plan is infeasible: {priced.problems[0]}")
        gen, *rest = priced.stages
        gen_group, *rest_groups = priced.stage_groups
        trainers = {g for st, g in zip(rest, rest_groups) if st.stage == "training"}
        apart = gen_group not in trainers
        call = priced.call_s
        synced = priced.sync_s + call[gen_group] * apart  # a sync across groups is a call too
        ready = 0.0 if not train_end else train_end[-1] + synced
        if plan.schedule == "async" and apart:
            lag = i - 1 - plan.staleness   # generation may use weights this many steps old
            ready = (train_end[lag] + synced) if lag >= 0 else 0.0
            ready = max(ready, gen_end_prev)
        start = max(ready, free.get(gen_group, 0.0)) + call[gen_group]
        spans.append(Span(gen_group, f"generation {gen.role}", i, start, start + gen.seconds))
        free[gen_group] = gen_end_prev = start + gen.seconds
        fused = plan.schedule == "fused"
        assess_end = free[gen_group]
        called: set[tuple[str, str]] = set()  # one call runs a stage's roles on a group
        for st, g in zip(rest, rest_groups):
            if st.stage != "assessment":
                continue
            begin = max(free.get(g, 0.0), start if fused and g != gen_group
                        else free[gen_group]) + call[g] * (("assessment", g) not in called)
            called.add(("assessment", g))
            end = max(begin + st.seconds, free[gen_group]) if fused else begin + st.seconds
            spans.append(Span(g, f"assessment {st.role}", i, begin, end))
            free[g] = end
            assess_end = max(assess_end, end)
        end_of_step = assess_end
        for st, g in zip(rest, rest_groups):
            if st.stage != "training":
                continue
            begin = max(free.get(g, 0.0), assess_end, train_end[-1] if train_end else 0.0
                        ) + call[g] * (("training", g) not in called)
            called.add(("training", g))
            spans.append(Span(g, f"training {st.role}", i, begin, begin + st.seconds))
            free[g] = begin + st.seconds
            end_of_step = max(end_of_step, free[g])
        for g in trainers:
            free[g] += synced  # the trainer sends the weights it made
        train_end.append(end_of_step)
    steps = len(workloads)
    makespan = max(s.end for s in spans)
    busy: dict[str, float] = {}
    for s in spans:
        busy[s.group] = busy.get(s.group, 0.0) + s.end - s.start
    warm = min(WARMUP_STEPS, steps - 2) if steps > 2 else 0
    step_s = ((train_end[-1] - train_end[warm]) / (steps - 1 - warm) if steps > 1
              else train_end[0])
    # a group busy the whole time sums its spans to the makespan give or take rounding
    idle = {g: max(0.0, 1 - b / makespan) for g, b in busy.items()}
    return Simulation(spans, step_s, idle, makespan, train_end)
