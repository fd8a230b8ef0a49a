"""`rlloom plan` and `rlloom simulate`: search plans for a model, algorithm, workload and
cluster; print them, emit JSON, or simulate one with a trace and a Gantt chart."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from rlloom.algos.presets import PRESETS
from rlloom.algos.rollout_correction import recomputes_behaviour
from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import Priced, role_models
from rlloom.perf.model.hardware import Hardware, hardware, load_hardware
from rlloom.perf.model.interval import Interval, step_interval
from rlloom.perf.model.shapes import ModelShape, model_shape
from rlloom.perf.model.workload import Lengths, Workload, lengths_from
from rlloom.perf.search.gantt import plot_gantt
from rlloom.perf.search.planner import Search, cost_per_step, describe, naive, search
from rlloom.perf.validation.simulate import simulate


def _sec(x: float) -> str:
    """Seconds with one decimal, or three significant digits below one second (a tiny model's
    step on a CPU)."""
    return f"{x:.1f}" if x >= 1 or x == 0 else f"{x:.3g}"


def parse_gpus(spec: str) -> tuple[int, str, int | None]:
    """'64xH100' -> (64, 'h100', None): the catalogue's devices per node; '2x8xH100' ->
    (16, 'h100', 8): 2 nodes of 8."""
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([a-z][\w.-]*)", spec.strip(), flags=re.IGNORECASE)
    if not m or int(m.group(2)) == 0 or (m.group(1) is not None and int(m.group(1)) == 0):
        raise ValueError(f"--gpus {spec!r} must look like 64xH100 (devices) or 8x8xH100 "
                         "(nodes x devices per node)")
    nodes, per = m.group(1), int(m.group(2))
    return ((int(nodes) * per, m.group(3).lower(), per) if nodes
            else (per, m.group(3).lower(), None))


def _row(p: Priced, hw: Hardware, interval: Interval | None = None) -> dict:
    return {"plan": describe(p.plan, p.gen_layout, p.micro_batch), "step_s": p.step_s,
            "step_interval_s": [interval.low, interval.high] if interval else None,
            "gen_s": p.gen_s, "assess_s": p.assess_s, "train_s": p.train_s, "sync_s": p.sync_s,
            "cost_usd": cost_per_step(p, hw), "devices": p.devices,
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
    epochs: int = 1  # passes over each step's batch (PPO epochs)
    minibatches: int = 1  # optimizer steps per epoch
    objective: str = "time"  # rank by step time, or by cost per step ("cost")
    runtime: str = "any"  # "torchrun": only plans `torchrun ... rlloom train PLAN_FILE` runs
    price_only: bool = False  # also plans the executor does not run yet (pp, cp, ep)
    hardware_file: Path | None = None  # a hardware file instead of --gpus's device name
    max_response: int = 0  # the generation cap of lognormal lengths (0: p99)
    staleness: int = 1  # the bound of the async plans searched
    partial_rollout: int = 0  # rollout.partial_tokens: tokens per response per step (0: off)
    lora: int = 0  # model.lora.rank of the actor's adapters (0: full training)
    turns: int = 1  # model turns per rollout, each but the last calling a tool
    tool_latency: tuple[float, float] = (0.0, 0.0)  # a tool call's p50 and p99 seconds
    tool_result: int = 0  # tokens a tool's result inserts into the response
    engine: str = "rlloom"  # rollout.engine: rlloom or vllm
    offload: bool = False  # also try ZeRO-3 layouts with their shards in host memory
    critic: str = ""  # the critic's model (preset or checkpoint); "": the actor's

    def critic_shape(self) -> ModelShape | None:
        return model_shape(self.critic) if self.critic else None

    def models(self, shape: ModelShape) -> dict[str, ModelShape | None]:
        """The shape of every model the algorithm builds, the policy's being `shape`."""
        return role_models(shape, PRESETS[self.algo].roles, critic=self.critic_shape())

    def workload(self) -> Workload:
        if self.lengths_from is not None:
            response = lengths_from(self.lengths_from)
        elif self.p99 > self.p50:
            response = Lengths("lognormal", self.p50, self.p99, cap=self.max_response)
        else:
            response = Lengths("fixed", self.p50)
        # offline DPO scores and trains on a chosen and a rejected response per prompt
        samples = self.samples if PRESETS[self.algo].online else 2
        return Workload(self.prompts, samples, self.prompt_len, response,
                        ppo_epochs=self.epochs, minibatches=self.minibatches,
                        policy_loss=PRESETS[self.algo].overrides.get("policy_loss", "ppo"),
                        partial_tokens=self.partial_rollout, lora_rank=self.lora,
                        turns=self.turns, tool_latency=_latency(*self.tool_latency),
                        tool_result_len=self.tool_result, engine=self.engine,
                        # the trainer recomputes another engine's log-probs (same rule as the
                        # runtime's)
                        recompute_logprobs=recomputes_behaviour(self.engine, "none"))

    def search(self, shape: ModelShape, wl: Workload, hw: Hardware, devices: int) -> Search:
        return search(shape, self.algo, wl, hw, devices, objective=self.objective,
                      runtime=self.runtime, price_only=self.price_only,
                      staleness=self.staleness, offload=self.offload,
                      critic=self.critic_shape())

    def cluster(self) -> tuple[int, Hardware]:
        """The device count and hardware; a node size (`2x8x...`) replaces the hardware's
        devices per node, where collectives leave NVLink for the NIC."""
        if self.hardware_file is not None:
            counts = self.gpus.split("x")
            if not all(c.isdigit() for c in counts) or len(counts) > 2:
                raise ValueError(f"--gpus {self.gpus!r}: with --hardware give the device "
                                 "count, e.g. --gpus 64, or nodes x devices, e.g. --gpus 8x8")
            hw = load_hardware(self.hardware_file)
            per = int(counts[-1]) if len(counts) == 2 else None
            devices = math.prod(int(c) for c in counts)
        else:
            devices, hw_name, per = parse_gpus(self.gpus)
            hw = hardware(hw_name)
        return devices, (replace(hw, devices_per_node=per) if per else hw)


def _latency(p50: float, p99: float) -> Lengths:
    """Tool-call seconds: lognormal from a median and a 99th percentile, fixed without one."""
    return Lengths("lognormal", p50, p99) if p99 > p50 > 0 else Lengths("fixed", p50)


def plan_file(p: Priced, title: str, algo: str | None = None, critic_path: str | None = None
              ) -> str:
    """A config file holding `plan:`, the micro-batch as `train.micro_batch_tokens` and the
    priced workload of an online algorithm (prompts per step, samples per prompt, the longest
    response), which `rlloom train` accepts (other settings keep their defaults; the plan's
    generation replicas need that many prompts); the generation group, when separate, is the
    "generation" layout. The token budget is the priced micro-batch at the longest context, so
    no micro-batch the runtime cuts holds more padded tokens.
    `algo`: the algorithm priced (`algo.name`); `critic_path`: the checkpoint the priced
    critic starts from (`model.critic_path`)."""
    wl = p.workload
    config: dict = {"plan": p.run_plan().model_dump(mode="json", exclude={"adapt"}),
                    "train": {"micro_batch_tokens": p.micro_batch_tokens}}
    if algo:
        config["algo"] = {"name": algo}
    if algo is None or PRESETS[algo].online:  # offline, K counts a chosen and a rejected
        config["train"]["prompts_per_step"] = wl.prompts
        config["rollout"] = {"n_samples": wl.samples,
                             "max_new_tokens": math.ceil(wl.response.max)}
    if wl.partial_tokens:  # whole chunks up to the priced longest response
        chunk = wl.partial_tokens
        config.setdefault("rollout", {}).update(
            partial_tokens=chunk, max_new_tokens=math.ceil(wl.response.max / chunk) * chunk)
    if wl.engine == "vllm":
        config.setdefault("rollout", {})["engine"] = "vllm"
    if wl.lora_rank:
        config["model"] = {"lora": {"rank": wl.lora_rank}}
    if critic_path:
        config.setdefault("model", {})["critic_path"] = str(Path(critic_path).resolve())
    body = yaml.safe_dump(config, sort_keys=False)
    return f"# {title}\n{body}"


def simulate_report(req: Request, which: str, steps: int, seed: int, out: Path) -> str:
    """Simulate the planner's best (or the naive) plan; write trace.json and gantt.png."""
    if not PRESETS[req.algo].online:
        raise ValueError(f"{req.algo} generates nothing: there is no timeline to simulate")
    devices, hw = req.cluster()
    shape, wl = model_shape(req.model), req.workload()
    chosen = naive(shape, req.algo, wl, hw, devices, critic=req.critic_shape()) \
        if which == "naive" else (req.search(shape, wl, hw, devices).ranked or [None])[0]
    if chosen is None:
        raise ValueError(f"no feasible {which} plan for {req.model} on {req.gpus}")
    models = req.models(shape)
    sim = simulate(chosen.plan, models, chosen.workload, hw, steps, seed, chosen.gen_layout)
    iv = step_interval(chosen.plan, models, chosen.workload, hw, chosen.gen_layout,
                       mid=chosen.step_s)
    out.mkdir(parents=True, exist_ok=True)
    sim.chrome_trace(out / "trace.json")
    label = describe(chosen.plan, chosen.gen_layout, chosen.micro_batch)
    plot_gantt(sim, out / "gantt.png", f"{which} plan")
    idle = ", ".join(f"{g} {f:.0%}" for g, f in sorted(sim.idle.items()))
    return (f"{which} plan {label}\n{steps} simulated steps: steady-state step "
            f"{_sec(sim.step_s)} s (priced at the workload's p50/p99: {_sec(chosen.step_s)} s, "
            f"range {iv} s); "
            f"idle: {idle}\nwrote {out / 'trace.json'} and {out / 'gantt.png'}")


Checker = Callable[[list[Priced]], tuple[list[Priced], list[str], dict[int, str]]]


def plan_report(req: Request, top: int, as_json: bool, write_plan: Path | None = None,
                check: Callable[[ModelShape, Hardware], Checker] | None = None) -> str:
    """`check` (`rlloom plan --rehearse`, outside this torch-free package): given the model
    and hardware, a function that takes the ranked plans and returns those kept, lines to
    print, and a plan-file note per kept plan (by `id`)."""
    devices, hw = req.cluster()
    shape, wl, model, algo = model_shape(req.model), req.workload(), req.model, req.algo
    found = req.search(shape, wl, hw, devices)
    checked: list[str] = []
    notes: dict[int, str] = {}
    if check is not None:
        found.ranked, checked, notes = check(shape, hw)(found.ranked)
    base = naive(shape, algo, wl, hw, devices, critic=req.critic_shape())
    models = req.models(shape)
    shown = found.ranked[:top]
    # 16 more pricings a plan: the ranks a reader compares get a range, the long tail none
    intervals: list[Interval | None] = [
        step_interval(p.plan, models, p.workload, hw, p.gen_layout, not PRESETS[algo].online,
                      mid=p.step_s) for p in shown[:INTERVAL_ROWS]]
    intervals += [None] * (len(shown) - len(intervals))
    if write_plan is not None and found.ranked:
        best = found.ranked[0]
        critic_dir = req.critic if req.critic and Path(req.critic).is_dir() else None
        rehearsed = f"\n# {notes[id(best)]}" if id(best) in notes else ""
        write_plan.write_text(plan_file(best, f"rlloom plan: {model} {algo} on {best.devices} x "
                                        f"{hw.name}, predicted {_sec(best.step_s)} s per step"
                                        f"{rehearsed}", algo, critic_dir))
    if as_json:
        return json.dumps({"seconds": found.seconds, "workload": asdict(wl),
                           "objective": req.objective,
                           "ranked": [_row(p, hw, iv) for p, iv in zip(shown, intervals)],
                           "naive": _row(base, hw) if base else None,
                           "rejected": found.rejected[:20]}, indent=2)
    runnable = (" (plans torchrun runs)" if req.runtime == "torchrun" else
                " (PRICE ONLY: plans with a cp, pp or ep the executor lacks do not run yet)"
                if req.price_only else " (plans the executor runs)")
    lines = [f"{model} {algo} on {devices} x {hw.name}{runnable}, ranked by "
             f"{OBJECTIVES[req.objective]}: "
             f"searched in {found.seconds:.2f} s, {len(found.ranked)} feasible plans, "
             f"{len(found.rejected)} rejected",
             f"{'step s':>8} {'range s':>13} {'gen s':>8} {'assess s':>8} {'train s':>8} "
             f"{'$/step':>8} {'devices':>7}  plan"]
    first = intervals[0] if intervals else None
    ties = [bool(i and iv and first and iv.overlaps(first)) for i, iv in enumerate(intervals)]
    for p, iv, tie in zip(shown, intervals, ties):
        lines.append(f"{_sec(p.step_s):>8} {str(iv or ''):>13} {_sec(p.gen_s):>8} "
                     f"{_sec(p.assess_s):>8} {_sec(p.train_s):>8} "
                     f"{cost_per_step(p, hw):8.2f} {p.devices:7d} {'~' if tie else ' '}"
                     f"{describe(p.plan, p.gen_layout, p.micro_batch)}")
    if any(ties):
        lines.append("~ its range overlaps the first plan's: not distinguishable from it "
                     "(range: 10th-90th percentile over sampled steps' response lengths, "
                     "widened by the hardware file's measured spread and calibration error)")
    if found.ranked and base is not None:
        lines += explain(found.ranked, base, hw, req.objective)
    for plan, reason in found.rejected[:3]:
        lines.append(f"rejected {plan}: {reason}")
    lines += checked
    if write_plan is not None and found.ranked:
        lines.append(f"wrote the best plan to {write_plan} (`rlloom train {write_plan}`)")
    return "\n".join(lines)


OBJECTIVES = {"time": "step time", "cost": "cost per step"}
INTERVAL_ROWS = 20  # ranked plans that get a step-time range


def explain(ranked: list[Priced], base: Priced, hw: Hardware, objective: str = "time"
            ) -> list[str]:
    """Why the first plan: how it compares with the naive plan stage by stage, what bounds its
    slowest stage, its memory headroom, and the best plan of every other placement."""
    best = ranked[0]
    split = {"generation": best.gen_s, "assessment": best.assess_s, "training": best.train_s}
    stage = max(split, key=split.__getitem__)
    worst = max((st for st in best.stages if st.stage == stage), key=lambda st: st.seconds)
    bounds = {"compute": worst.compute_s, "memory": worst.memory_s, "communication": worst.comm_s,
              "operator-dispatch": worst.dispatch_s, "tool": worst.wait_s}
    bound = max(bounds, key=bounds.__getitem__)
    usable = hw.mem_gib * mem.USABLE
    naive_plan = (f"the naive plan (co-located, data parallel only, sync, micro-batch "
                  f"{base.micro_batch}, {base.devices} devices)")
    if objective == "cost":
        head = (f"why: ${cost_per_step(best, hw):.2f} per step on {best.devices} devices, "
                f"{cost_per_step(base, hw) / cost_per_step(best, hw):.2f}x cheaper than "
                f"{naive_plan}: ${cost_per_step(base, hw):.2f} and {_sec(base.step_s)} s per "
                "step; ")
    else:
        head = (f"why: {base.step_s / best.step_s:.2f}x faster than {naive_plan}: "
                f"{_sec(base.step_s)} s per step; ")
    lines = [
        head + f"generation {_sec(base.gen_s)} -> {_sec(best.gen_s)} s, assessment "
        f"{_sec(base.assess_s)} -> {_sec(best.assess_s)} s, training {_sec(base.train_s)} -> "
        f"{_sec(best.train_s)} s" + (f", weight sync {_sec(best.sync_s)} s" if best.sync_s else ""),
        f"  bottleneck: {stage}, {split[stage] / best.step_s:.0%} of the step; its slowest part "
        f"({worst.role}) is {bound}-bound: compute {_sec(worst.compute_s)} s, memory "
        f"{_sec(worst.memory_s)} s, communication {_sec(worst.comm_s)} s"
        + (f", operator dispatch {_sec(worst.dispatch_s)} s" if worst.dispatch_s else "")
        + (f", waiting on tools {_sec(worst.wait_s)} s" if worst.wait_s else ""),
        "  peak memory per device: " + ", ".join(
            f"{g} {gib:.1f} GiB" for g, gib in sorted(best.mem_gib.items()))
        + f" of {usable:.1f} usable"]
    others: dict[str, Priced] = {}
    for p in ranked[1:]:
        others.setdefault(f"{p.plan.placement}/{p.plan.schedule}", p)
    mine = f"{best.plan.placement}/{best.plan.schedule}"
    alternatives = [f"{k} ${cost_per_step(p, hw):.2f} ({p.devices} devices)"
                    if objective == "cost" else f"{k} {_sec(p.step_s)} s"
                    for k, p in others.items() if k != mine]
    if alternatives:
        lines.append("  best of each other placement/schedule: " + ", ".join(alternatives))
    return lines
