"""Enumerate plans for a model, algorithm, workload and cluster; rank the feasible ones by
predicted step time and keep the reasons the others were rejected.

The search covers placement (colocated, interleaved, disaggregated) x per-role layouts (DP with
ZeRO 0-3, TP, PP, CP, EP for MoE models, activation checkpointing) x schedule (sync, fused,
async with staleness 1) x micro-batch size (MICRO_BATCHES sequences per device).

Pruning (so 64 devices take a few seconds): TP is a power of two within a node dividing the
head count; every frozen role gets the same layout; device groups are sized in eighths of the
cluster; each role keeps only its TOP_K fastest layouts judged alone on its own group before
the joint (memory-coupled) pricing; hybrid actor layouts are tried colocated (generation
layout + resharding) and as async's separate generation group; interleaved placement is searched
only where it differs from disaggregated (a separate critic trains beside the actor).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

from rlloom.algos.presets import PRESETS
from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.compose import TRAINABLE, Priced, price, role_models
from rlloom.perf.model.hardware import Hardware
from rlloom.perf.model.model_state import host_fits, resident_bytes
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload
from rlloom.plan import (Layout, Plan, engine_problems, lora_problems, runnable_problems,
                         unsplit_degrees)

TOP_K = 4
MICRO_BATCHES = (1, 2, 4, 8, 16)
CONTEXT_PARALLEL = (1, 2, 4)
INF = float("inf")


@dataclass
class Search:
    """Feasible plans fastest first, and (description, reason) for the rejected ones.
    `runnable`: rank only plans the executor runs (`plan.runnable_problems`); `offload`:
    ZeRO-3 layouts were also tried with their shards in host memory."""
    ranked: list[Priced]
    rejected: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    runnable: bool = True
    offload: bool = False
    latent: bool = False  # the actor's latent attention (`plan.engine_problems`)

    def add(self, p: Priced) -> None:
        problems = list(p.problems)
        if self.runnable:
            models = tuple(r for r in p.plan.layouts if r != "generation")
            problems += runnable_problems(p.plan, models)
            gen = {"generation": p.gen_layout} if p.gen_layout is not None else {}
            if p.workload.lora_rank:
                problems += lora_problems({**p.plan.layouts, **gen})
            problems += engine_problems(p.workload.engine, p.plan.model_copy(
                update={"layouts": {**p.plan.layouts, **gen}}), self.latent)
        if not problems:
            self.ranked.append(p)
        else:
            self.rejected.append((describe(p.plan, p.gen_layout, p.micro_batch),
                                  "; ".join(problems)))


def layouts(n: int, shape: ModelShape, hw: Hardware, trainable: bool,
            runnable: bool = False, pipelined: bool = False, offload: bool = False
            ) -> list[Layout]:
    """Candidate layouts on n devices; `runnable`: only those the executor applies (dp with
    ZeRO 0-3 x tp, whose TP shards the KV heads and the MLP too, and for trainable roles
    cp and pp (each with tp or not), and an ep dividing dp; the same cp and pp for a
    frozen role that may be `pipelined`, the reference; see `plan.runnable_problems`).
    `offload`: each ZeRO-3 layout also with its shards in host memory."""
    out = []
    tp = 1
    splits = list(itertools.product((1, 2, 4), CONTEXT_PARALLEL))
    if runnable:
        splits = splits if trainable or pipelined else [(1, 1)]
    while tp <= min(n, hw.devices_per_node):
        for pp, cp in splits:
            if shape.heads % tp or n % (tp * pp * cp) or shape.layers % pp:
                continue
            if tp * cp > hw.devices_per_node:  # every layer's collectives: inside a node
                continue
            if runnable and not _tp_applies(tp, shape):
                continue
            dp = n // (tp * pp * cp)
            zeros = (0, 1, 2, 3) if trainable else (0, 3)
            eps = _ep_degrees(shape, dp)
            if runnable and not trainable:  # the executor spreads experts of models that train
                eps = [1]
            for zero, ep in itertools.product(zeros if dp > 1 else (0,), eps):
                offloads = (False, True) if offload and zero == 3 else (False,)
                for ckpt, off in itertools.product(
                        (False, True) if trainable else (False,), offloads):
                    out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                      activation_checkpointing=ckpt, offload=off))
        tp *= 2
    return out


def _ep_degrees(shape: ModelShape, ranks: int) -> list[int]:
    """Powers of two dividing both the expert count and the dp ranks experts spread over."""
    if not shape.moe:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if shape.n_experts % e == 0 and ranks % e == 0]


def describe(p: Plan, gen: Layout | None, micro_batch: int) -> str:
    def short(x: Layout) -> str:
        s = f"dp{x.dp}xtp{x.tp}xpp{x.pp}"
        s += (f"xcp{x.cp}" if x.cp > 1 else "") + (f"-ep{x.ep}" if x.ep > 1 else "")
        ckpt = "-ckpt" if x.activation_checkpointing else ""
        return s + (f"-z{x.zero}" if x.zero else "") + ckpt + ("-offload" if x.offload else "")
    roles = ", ".join(f"{r}={short(x)}" for r, x in p.layouts.items() if r != "generation")
    gen = gen or p.layouts.get("generation")
    generation = f", generation={short(gen)}" if gen else ""
    beside = "+ref" if p.reference == "with_actor" else ""
    return (f"{p.placement}{beside}/{p.schedule}/{p.actor_critic}/mb{micro_batch}: "
            f"{roles}{generation}")


def _solo(role: str, shape: ModelShape, x: Layout, wl: Workload, hw: Hardware,
          with_gen: bool, rollout_only: bool = False) -> float:
    """A role's time alone on its own group, INF when it does not fit there."""
    usable = hw.mem_bytes * mem.USABLE
    if rollout_only:
        return cost.generation(shape, x, wl, hw, usable - 2 * mem.PARAM_B *
                               mem.params_per_device(shape, x)).seconds
    trainable = role in TRAINABLE
    # a LoRA actor keeps its base frozen: adapters' gradients and moments only
    state, on_host = resident_bytes(shape, x, hw, trainable,
                                    wl.lora_rank if role == "actor" else 0)
    if not host_fits(on_host, hw):
        return INF
    total = 0.0
    if role != "actor":
        f = cost.forward(shape, x, wl, hw, role, role == "reference")
        if state + f.transient_bytes > usable:
            return INF
        total += f.seconds
    if trainable:
        t = cost.training(shape, x, wl, hw, role, role == "actor")
        if state + t.transient_bytes > usable:
            return INF
        total += t.seconds
    if with_gen:
        extra = mem.PARAM_B * mem.params_per_device(shape, x) if x.zero == 3 else 0.0
        total += cost.generation(shape, x, wl, hw, usable - state - extra).seconds
    return total


def _top(role: str, shape: ModelShape, n: int, wl: Workload, hw: Hardware, with_gen: bool,
         rollout_only: bool, cache: dict, runnable: bool = False, pipelined: bool = False,
         offload: bool = False) -> list[Layout]:
    """The TOP_K fastest layouts of a role alone on n devices that fit; `runnable`: only those
    the executor applies (and, for a layout that generates, the engine runs); `pipelined`: a
    frozen role may take pp stages or cp shards;
    `offload`: ZeRO-3 layouts may offload."""
    key = (role, n, with_gen, rollout_only, runnable, pipelined, offload)
    if key not in cache:
        trainable = role in TRAINABLE and not rollout_only
        # a generation-only layout holds no optimizer state: ZeRO would only add gathers
        candidates = [x for x in layouts(n, shape, hw, trainable, runnable, pipelined,
                                         offload) if not (rollout_only and x.zero)]
        if runnable and (with_gen or rollout_only):  # only layouts the engine generates in
            candidates = [x for x in candidates
                          if not engine_problems(wl.engine, Plan(layouts={"actor": x}),
                                                 shape.latent)]
        scored = [(_solo(role, shape, x, wl, hw, with_gen, rollout_only), i, x)
                  for i, x in enumerate(candidates)]
        cache[key] = [x for s, _, x in sorted(scored) if s < INF][:TOP_K]
    return cache[key]


def _tp_applies(tp: int, shape: ModelShape) -> bool:
    """TP also shards the KV heads, the MLP and every expert's features; not a model's
    blocks it does not split (`plan.unsplit_degrees`)."""
    if tp > 1 and "tp" in unsplit_degrees(shape.latent, shape.shared_ffn > 0):
        return False
    return shape.kv_heads % tp == 0 and shape.ffn % tp == 0 and shape.moe_ffn % tp == 0


def _degrees(x: Layout) -> tuple[int, ...]:
    return x.dp, x.tp, x.pp, x.cp, x.ep


def _splits(units: int, parts: int) -> list[tuple[int, ...]]:
    return [c for c in itertools.product(range(1, units), repeat=parts) if sum(c) == units]


def search(actor: ModelShape, algo: str, wl: Workload, hw: Hardware, devices: int,
           reward: ModelShape | None = None, objective: str = "time",
           runtime: str = "any", price_only: bool = False, staleness: int = 1,
           offload: bool = False, critic: ModelShape | None = None,
           roles: tuple[str, ...] | None = None) -> Search:
    """Rank the plans this module enumerates for `devices` devices of `hw`, at every micro-batch
    size of MICRO_BATCHES (`wl.micro_batch` is replaced), fastest first; with objective "cost",
    also on 1/2, 1/4 and 1/8 of the devices, cheapest per step first (a slower plan on fewer
    devices can cost less). Runtime "torchrun": only the colocated plans, which one torchrun
    world runs as one group (`runtime/executor/preflight.torchrun_problems`). By default only
    plans the executor runs are searched and ranked; `price_only` widens the search to the pipeline,
    context and expert layouts the model prices but the executor does not run yet. Async
    plans are searched at bound `staleness`. `offload`: also try each ZeRO-3 layout with its
    shards in host memory (`Layout.offload`), which trades memory for host traffic.
    `critic`: a critic of its own shape (default: the actor's). `roles`: the models a run
    builds, when not the preset's (a run without a KL term has no reference)."""
    start = time.perf_counter()
    result = Search([], runnable=not price_only, offload=offload, latent=actor.latent)
    if objective == "cost" and hw.price_per_hour <= 0:
        raise ValueError(f"hardware {hw.name} has no price per device-hour; use --objective "
                         "time or a hardware file with price_per_hour")
    counts = [devices // d for d in (1, 2, 4, 8) if devices % d == 0] \
        if objective == "cost" else [devices]
    for n, micro_batch in itertools.product(counts, MICRO_BATCHES):
        _search_at(actor, algo, replace(wl, micro_batch=micro_batch), hw, n, reward, result,
                   staleness, critic, roles)
    if runtime == "torchrun":  # one world: every model on all of it
        result.ranked = [p for p in result.ranked if p.plan.placement == "colocated"]
    # stable: of equally good plans the smaller micro-batch (less memory) comes first
    result.ranked.sort(key=(lambda q: cost_per_step(q, hw)) if objective == "cost"
                       else (lambda q: q.step_s))
    result.seconds = time.perf_counter() - start
    return result


def cost_per_step(p: Priced, hw: Hardware) -> float:
    """USD of device time one step takes."""
    return p.step_s * p.devices * hw.price_per_hour / 3600


def _search_at(actor: ModelShape, algo: str, wl: Workload, hw: Hardware, devices: int,
               reward: ModelShape | None, result: Search, staleness: int = 1,
               critic: ModelShape | None = None, roles: tuple[str, ...] | None = None) -> None:
    """Plans on the device groups of `plan.device_groups`: colocated (all roles on every
    device), interleaved (actor and critic with generation, the reference apart) and
    disaggregated (generation, training and the reference each on their own share, or the
    reference beside the actor on the training share). The critic
    trains on the actor's devices; a reward model scores beside generation and runs
    data-parallel there, so the plans give it no layout."""
    online = PRESETS[algo].online
    models = role_models(actor, roles or PRESETS[algo].roles, reward, critic)
    active = [r for r, m in models.items() if m is not None]
    ref = ["reference"] if "reference" in active else []
    # a shared actor-critic changes the algorithm (one backbone for policy and values): the
    # planner keeps the critic the algorithm asks for
    ac_modes = ("separate",)
    unit = devices // 8 if devices % 8 == 0 and devices >= 8 else 1
    units = devices // unit
    cache: dict = {}

    def top(role: str, n: int, with_gen: bool = False, rollout: bool = False) -> list[Layout]:
        shape = models[role] if role in models and models[role] else actor
        return _top(role, shape, n, wl, hw, with_gen, rollout, cache, runnable=result.runnable,
                    pipelined=role == "reference", offload=result.offload)

    def add(plan_kw: dict, choice: dict[str, list[Layout]], gen: list[Layout] | None) -> None:
        names = list(choice)
        for combo in itertools.product(*(choice[r] for r in names), *([gen] if gen else [])):
            lay = dict(zip(names, combo))
            p = Plan(layouts=lay, **plan_kw)
            g = combo[-1] if gen else None
            if g is not None and p.placement == "colocated" and _degrees(g) == _degrees(
                    lay["actor"]):
                continue  # the actor's own sharding: that is the plan without a copy
            result.add(price(p, models, wl, hw, g, offline=not online))

    schedules = [("sync", 0), ("fused", 0), ("async", staleness)] if online else [("sync", 0)]
    for ac in ac_modes:
        trained = ["actor"] + (["critic"] if ac == "separate" and "critic" in active else [])
        # colocated, sync: everyone on all devices
        choice = {r: top(r, devices, with_gen=(r == "actor" and online)) for r in trained + ref}
        if all(choice.values()):
            add({"placement": "colocated", "actor_critic": ac}, choice, None)
            if online:  # hybrid: generate with a generation-only layout, reshard each step;
                # the actor's own layout then only trains, so it is ranked by training alone
                add({"placement": "colocated", "actor_critic": ac},
                    {**choice, "actor": top("actor", devices)}, top("actor", devices, rollout=True))
        else:
            result.rejected.append((f"colocated/{ac}/mb{wl.micro_batch}", "some role fits no "
                                    f"layout on {devices} devices"))
        # interleaved: actor and critic share one group with generation (memory-coupled, so
        # each keeps its TOP_K), the reference another; with one trainable role it is the
        # disaggregated plan without a generation group of its own
        if len(trained) == 2 and ref:
            for n_train, n_frozen in _splits(units, 2):
                n_train, n_frozen = n_train * unit, n_frozen * unit
                choice = {"actor": top("actor", n_train, with_gen=online),
                          "critic": top("critic", n_train),
                          "reference": top("reference", n_frozen)[:1]}
                if not all(choice.values()):
                    result.rejected.append((f"interleaved split {[n_train, n_frozen]} "
                                            f"mb{wl.micro_batch}",
                                            "some role fits no layout on its group"))
                    continue
                add({"placement": "interleaved", "actor_critic": ac}, choice, None)
        if not online:
            continue
        # disaggregated: generation, training and the reference each on their own share, or
        # the reference beside the actor on the training share
        splits = [(s, "apart") for s in _splits(units, 2 + len(ref))]
        splits += [(s, "with_actor") for s in (_splits(units, 2) if ref else [])]
        for split, where in splits:
            n_gen, n_train, *n_ref = [s * unit for s in split]
            beside = ref if where == "with_actor" else []
            # separate groups do not share memory: each role's own best layout is best, but
            # roles sharing the training devices keep their TOP_K there
            keep = TOP_K if len(trained) + len(beside) > 1 else 1
            choice = {r: top(r, n_train)[:keep] for r in trained + beside}
            if n_ref:
                choice["reference"] = top("reference", n_ref[0])[:1]
            gen = top("actor", n_gen, rollout=True)[:1]
            if not all(choice.values()) or not gen:
                result.rejected.append((f"disaggregated split {[n_gen, n_train, *n_ref]}"
                                        f"{', reference with the actor' if beside else ''} "
                                        f"mb{wl.micro_batch}",
                                        "some role fits no layout on its group"))
                continue
            for sched, eta in schedules:
                add({"placement": "disaggregated", "schedule": sched, "staleness": eta,
                     "actor_critic": ac, "reference": where}, choice, gen)


def naive(actor: ModelShape, algo: str, wl: Workload, hw: Hardware, devices: int,
          reward: ModelShape | None = None, critic: ModelShape | None = None
          ) -> Priced | None:
    """Everything colocated, DP only, sync, with the lowest ZeRO stage (and checkpointing only
    if needed) that fits; None when none does."""
    models = role_models(actor, PRESETS[algo].roles, reward, critic)
    offline = not PRESETS[algo].online
    for ckpt, zero in itertools.product((False, True), (0, 1, 2, 3)):
        trained = Layout(dp=devices, zero=zero, activation_checkpointing=ckpt)
        lay = {r: trained if r in TRAINABLE else Layout(dp=devices)
               for r, m in models.items() if m is not None and r != "reward"}
        priced = price(Plan(layouts=lay), models, wl, hw, offline=offline)
        if priced.feasible:
            return priced
    return None
