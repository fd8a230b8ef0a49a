"""`rlloom plan` and `rlloom simulate`: search plans for a model, algorithm, workload and
cluster; print them, emit JSON, or simulate one with a trace and a Gantt chart."""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from rlloom.algos.presets import PRESETS
from rlloom.perf.compose import Priced, role_models
from rlloom.perf.gantt import plot_gantt
from rlloom.perf.hardware import Hardware, hardware
from rlloom.perf.planner import describe, naive, search
from rlloom.perf.shapes import model_shape
from rlloom.perf.simulate import simulate
from rlloom.perf.workload import Lengths, Workload, lengths_from_metrics


def parse_gpus(spec: str) -> tuple[int, str]:
    """'64xH100' -> (64, 'h100')."""
    m = re.fullmatch(r"(\d+)x([\w.-]+)", spec.strip(), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--gpus {spec!r} must look like 64xH100")
    return int(m.group(1)), m.group(2).lower()


def _row(p: Priced) -> dict:
    return {"plan": describe(p.plan, p.gen_layout, p.micro_batch), "step_s": p.step_s,
            "gen_s": p.gen_s, "assess_s": p.assess_s, "train_s": p.train_s, "sync_s": p.sync_s,
            "micro_batch": p.micro_batch,
            "mem_gib": p.mem_gib, "plan_json": p.plan.model_dump(mode="json"),
            "gen_layout": p.gen_layout.model_dump(mode="json") if p.gen_layout else None}


@dataclass(frozen=True)
class Request:
    """What `rlloom plan` and `rlloom simulate` are asked to price."""
    model: str
    algo: str
    gpus: str
    prompts: int
    samples: int
    prompt_len: int
    p50: int
    p99: int
    lengths_from: Path | None = None

    def workload(self) -> Workload:
        if self.lengths_from is not None:
            response = lengths_from_metrics(self.lengths_from)
        elif self.p99 > self.p50:
            response = Lengths("lognormal", self.p50, self.p99)
        else:
            response = Lengths("fixed", self.p50)
        # offline DPO scores and trains on a chosen and a rejected response per prompt
        samples = self.samples if PRESETS[self.algo].online else 2
        return Workload(self.prompts, samples, self.prompt_len, response)

    def cluster(self) -> tuple[int, Hardware]:
        devices, hw_name = parse_gpus(self.gpus)
        return devices, hardware(hw_name)


def plan_file(p: Priced, title: str) -> str:
    """A config file holding `plan:` and the micro-batch as `train.micro_batch_tokens`, which
    `rlloom train` accepts (other settings keep their defaults); the generation group, when
    separate, is the "rollout" layout. The token budget is the priced micro-batch at the
    longest context, so no micro-batch the runtime cuts holds more padded tokens."""
    plan = p.plan.model_copy(deep=True)
    if p.gen_layout is not None:
        plan.layouts["rollout"] = p.gen_layout
    budget = math.ceil(p.micro_batch * p.workload.max_context)
    body = yaml.safe_dump({"plan": plan.model_dump(mode="json"),
                           "train": {"micro_batch_tokens": budget}}, sort_keys=False)
    return f"# {title}\n{body}"


def simulate_report(req: Request, which: str, steps: int, seed: int, out: Path) -> str:
    """Simulate the planner's best (or the naive) plan; write trace.json and gantt.png."""
    if not PRESETS[req.algo].online:
        raise ValueError(f"{req.algo} generates nothing: there is no timeline to simulate")
    devices, hw = req.cluster()
    shape, wl = model_shape(req.model), req.workload()
    chosen = naive(shape, req.algo, wl, hw, devices) if which == "naive" else \
        (search(shape, req.algo, wl, hw, devices).ranked or [None])[0]
    if chosen is None:
        raise ValueError(f"no feasible {which} plan for {req.model} on {req.gpus}")
    sim = simulate(chosen.plan, role_models(shape, PRESETS[req.algo].roles), chosen.workload,
                   hw, steps, seed, chosen.gen_layout)
    out.mkdir(parents=True, exist_ok=True)
    sim.chrome_trace(out / "trace.json")
    label = describe(chosen.plan, chosen.gen_layout, chosen.micro_batch)
    plot_gantt(sim, out / "gantt.png", f"{which} plan")
    idle = ", ".join(f"{g} {f:.0%}" for g, f in sorted(sim.idle.items()))
    return (f"{which} plan {label}\n{steps} simulated steps: steady-state step "
            f"{sim.step_s:.1f} s (priced at the workload's p50/p99: {chosen.step_s:.1f} s); "
            f"idle: {idle}\nwrote {out / 'trace.json'} and {out / 'gantt.png'}")


def plan_report(req: Request, top: int, as_json: bool, write_plan: Path | None = None) -> str:
    devices, hw = req.cluster()
    shape, wl, model, algo = model_shape(req.model), req.workload(), req.model, req.algo
    found = search(shape, algo, wl, hw, devices)
    base = naive(shape, algo, wl, hw, devices)
    if write_plan is not None and found.ranked:
        best = found.ranked[0]
        write_plan.write_text(plan_file(best, f"rlloom plan: {model} {algo} on {devices} x "
                                        f"{hw.name}, predicted {best.step_s:.1f} s per step"))
    if as_json:
        return json.dumps({"seconds": found.seconds, "workload": asdict(wl),
                           "ranked": [_row(p) for p in found.ranked[:top]],
                           "naive": _row(base) if base else None,
                           "rejected": found.rejected[:20]}, indent=2)
    lines = [f"{model} {algo} on {devices} x {hw.name}: searched in {found.seconds:.2f} s, "
             f"{len(found.ranked)} feasible plans, {len(found.rejected)} rejected",
             f"{'step s':>8} {'gen s':>8} {'assess s':>8} {'train s':>8}  plan"]
    for p in found.ranked[:top]:
        lines.append(f"{p.step_s:8.1f} {p.gen_s:8.1f} {p.assess_s:8.1f} {p.train_s:8.1f}  "
                     f"{describe(p.plan, p.gen_layout, p.micro_batch)}")
    if found.ranked and base is not None:
        best = found.ranked[0]
        stage = max(("generation", best.gen_s), ("assessment", best.assess_s),
                    ("training", best.train_s), key=lambda s: s[1])[0]
        lines += [f"naive plan (co-located, data parallel only, sync): {base.step_s:.1f} s "
                  f"per step; best is {base.step_s / best.step_s:.2f}x faster; its bottleneck "
                  f"is {stage}"]
    for plan, reason in found.rejected[:3]:
        lines.append(f"rejected {plan}: {reason}")
    if write_plan is not None and found.ranked:
        lines.append(f"wrote the best plan to {write_plan} (`rlloom train {write_plan}`)")
    return "\n".join(lines)
