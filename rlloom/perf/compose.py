"""Price a Plan: stage costs per role, memory per device group, and the step time composed by
placement and schedule (PERF_MODEL.md's composition table).

Groups: colocated puts every role on one group; interleaved puts the trainable roles (actor,
critic) on one group and the frozen ones (reference, reward) on another; disaggregated gives
each role its own. Generation runs on the actor's group unless `gen_layout` gives it its own
rollout group (needed by async). Within a group stages run one after another (sums); across
groups they run concurrently (maxima), so colocated-sync is the table's plain sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rlloom.perf import comm, cost
from rlloom.perf import memory as mem
from rlloom.perf.cost import StageCost
from rlloom.perf.hardware import GIB, Hardware
from rlloom.perf.shapes import ModelShape
from rlloom.perf.workload import Workload
from rlloom.plan import Layout, Plan

TRAINABLE = ("actor", "critic")
ROLLOUT = "rollout"


@dataclass
class Priced:
    """A plan with its predicted step time, stage costs and memory verdict."""
    plan: Plan
    gen_layout: Layout | None
    devices: int
    step_s: float
    gen_s: float
    assess_s: float
    train_s: float
    sync_s: float
    stages: list[StageCost]
    mem_gib: dict[str, float]  # peak per device, by group
    workload: Workload  # as priced: the planner varies its micro-batch size
    problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def micro_batch(self) -> int:
        return self.workload.micro_batch


def role_models(actor: ModelShape, roles: tuple[str, ...],
                reward: ModelShape | None = None) -> dict[str, ModelShape | None]:
    """Reference and critic share the actor's shape; the reward is a model or, when None, a
    rule verifier whose cost the model leaves out (it runs on CPUs)."""
    models: dict[str, ModelShape | None] = {}
    for role in roles:
        models[role] = reward if role == "reward" else actor
    return models


def group_of(plan: Plan, role: str) -> str:
    if plan.placement == "colocated":
        return "all"
    if plan.placement == "interleaved":
        return "trainable" if role in TRAINABLE else "frozen"
    return role


def generation_group(plan: Plan, gen_layout: Layout | None) -> str:
    """Where generation runs: its own rollout group when a plan that is not colocated gives it
    a layout; otherwise the actor's group (a colocated hybrid layout generates on the training
    devices)."""
    gen_layout = gen_layout or plan.layouts.get("rollout")
    if gen_layout is not None and plan.placement != "colocated":
        return ROLLOUT
    return group_of(plan, "actor")


def reshard_seconds(shape: ModelShape, train: Layout, gen: Layout, hw: Hardware) -> float:
    """Training layout -> generation layout on the same devices: every device all-gathers its
    generation share of the bf16 weights from the training shards across the whole group."""
    world = train.world_size
    return comm.gather_or_scatter(hw, world, world, mem.PARAM_B * mem.params_per_device(shape, gen))


def price(plan: Plan, models: dict[str, ModelShape | None], wl: Workload, hw: Hardware,
          gen_layout: Layout | None = None, offline: bool = False,
          gen_copy: bool = False) -> Priced:
    """Predict one RL step of `plan`; `models` maps each role the algorithm needs to its shape.
    The generation layout is `gen_layout`, else the plan's "rollout" layout, else the actor's.
    `gen_copy`: a colocated actor generates on its own copy (resharded every step) even in
    its training layout, as the torchrun trainer does when the actor trains data-parallel.
    Offline (DPO) steps generate nothing: the workload's K samples are the chosen and rejected
    responses, scored by the reference and trained on."""
    gen_layout = gen_layout or plan.layouts.get("rollout")
    shared = plan.actor_critic == "shared"
    active = {r: m for r, m in models.items() if m is not None and not (shared and r == "critic")}
    groups: dict[str, list[str]] = {}
    for role in active:
        groups.setdefault(group_of(plan, role), []).append(role)
    gen_group = generation_group(plan, gen_layout)
    hybrid = gen_layout is not None and gen_group != ROLLOUT and (
        gen_copy or gen_layout != plan.layout("actor"))
    actor, gen = models["actor"], gen_layout or plan.layout("actor")
    assert actor is not None
    problems: list[str] = []
    if plan.schedule == "async" and gen_group != ROLLOUT:
        problems.append("async needs generation on its own devices (give a gen_layout)")

    usable = hw.mem_bytes * mem.USABLE
    resident = {g: sum(mem.model_state_bytes(active[r], plan.layout(r), r in TRAINABLE)
                       for r in rs) for g, rs in groups.items()}
    if gen_group == ROLLOUT:
        copies = 2 if plan.schedule == "async" else 1  # shadow copy receives the next weights
        resident[ROLLOUT] = copies * mem.PARAM_B * mem.params_per_device(actor, gen)

    stages: list[StageCost] = []
    peak: dict[str, float] = dict(resident)
    # ZeRO-3 gathers full weights to generate; a hybrid layout holds a generation copy
    extra = mem.PARAM_B * mem.params_per_device(actor, gen) if gen_group != ROLLOUT and \
        (plan.layout("actor").zero == 3 or hybrid) else 0.0
    g_cost = cost.skipped("generation", "actor") if offline else \
        cost.generation(actor, gen, wl, hw, usable - resident[gen_group] - extra)
    stages.append(g_cost)
    peak[gen_group] = max(peak[gen_group], resident[gen_group] + extra + g_cost.transient_bytes)
    if g_cost.seconds == float("inf"):
        problems.append(f"generation: one rollout's KV cache ({g_cost.transient_bytes / GIB:.1f}"
                        f" GiB per device) does not fit next to {resident[gen_group] / GIB:.1f}"
                        f" GiB of model state; the device has {hw.mem_gib:g} GiB")

    for role, shape in active.items():
        if role in ("reference", "reward") or (role == "critic" and not shared):
            # the runtime's shared prompt pass serves log-probs, not value or reward heads
            stages.append(cost.forward(shape, plan.layout(role), wl, hw, role,
                                       role == "reference", prompts_once=role == "reference"))
        if role in TRAINABLE:
            stages.append(cost.training(shape, plan.layout(role), wl, hw, role, role == "actor",
                                        prompts_once=role == "actor" and not shared))
    for st in stages[1:]:
        g = group_of(plan, st.role)
        need = resident[g] + st.transient_bytes
        peak[g] = max(peak[g], need)
        if need > usable:
            problems.append(f"{st.role} {st.stage} needs {need / GIB:.1f} GiB per device, the "
                            f"device has {hw.mem_gib:g} ({usable / GIB:.1f} usable)")

    def per_group(stage: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in stages:
            if st.stage == stage:
                g = group_of(plan, st.role)
                out[g] = out.get(g, 0.0) + st.seconds
        return out

    g_s = g_cost.seconds
    a_by, t_by = per_group("assessment"), per_group("training")
    a_s, t_s = max(a_by.values(), default=0.0), max(t_by.values(), default=0.0)
    sync_s = 0.0
    if gen_group == ROLLOUT:
        sync_s = comm.broadcast_between_groups(hw, mem.PARAM_B * mem.params_per_device(actor, gen))
    elif hybrid:
        sync_s = reshard_seconds(actor, plan.layout("actor"), gen, hw)
    a_on_gen = gen_group in a_by
    if plan.schedule == "async" and plan.staleness > 0 and gen_group == ROLLOUT:
        busy_train = max(t_by.get(g, 0.0) + a_by.get(g, 0.0) for g in t_by) if t_by else 0.0
        step = max(g_s + a_s, t_s, busy_train) + sync_s
    elif plan.schedule == "fused" and not a_on_gen:
        step = max(g_s, a_s) + t_s + sync_s
    else:
        step = g_s + a_s + t_s + sync_s
    sizes = {g: max(plan.layout(r).world_size for r in rs) for g, rs in groups.items()}
    if gen_group == ROLLOUT:
        sizes[ROLLOUT] = gen.world_size
    else:
        sizes[gen_group] = max(sizes[gen_group], gen.world_size)
    return Priced(plan, gen_layout, sum(sizes.values()), step, g_s, a_s, t_s, sync_s, stages,
                  {g: b / GIB for g, b in peak.items()}, wl, problems)
