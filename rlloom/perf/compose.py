"""Price a Plan: stage costs per role, memory per device group, and the step time composed by
placement and schedule (docs/performance-model.md's composition).

Groups are `plan.device_groups`: the runtime starts the same ones. Within a group stages run
one after another (sums); across groups they run concurrently (maxima), so colocated-sync is
the table's plain sum. Weights cross groups after every optimizer step: the actor's to a
generation group of its own, the critic's to an assessment group's copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlloom.algos.presets import DECOUPLED_LOSSES
from rlloom.perf import comm, cost
from rlloom.perf import memory as mem
from rlloom.perf.cost import StageCost
from rlloom.perf.hardware import GIB, Hardware
from rlloom.perf.model_state import host_fits, resident_bytes
from rlloom.perf.shapes import ModelShape
from rlloom.perf.workload import Workload
from rlloom.plan import (
    STAGES,
    TRAINABLE,
    Layout,
    Plan,
    device_groups,
    generation_layout,
    model_layout,
    needs_generation_copy,
    placement_problems,
    stage_group,
)


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
    stage_groups: list[str]  # the device group each of `stages` runs on
    problems: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def micro_batch(self) -> int:
        return self.workload.micro_batch


def role_models(actor: ModelShape, roles: tuple[str, ...], reward: ModelShape | None = None,
                critic: ModelShape | None = None) -> dict[str, ModelShape | None]:
    """The reference shares the actor's shape; the critic too unless it is a model of its own
    (`model.critic_path`); the reward is a model or, when None, a rule verifier whose cost
    the model leaves out (it runs on CPUs)."""
    given = {"reward": reward, "critic": critic or actor}
    return {role: given.get(role, actor) for role in roles}


def reshard_seconds(shape: ModelShape, train: Layout, gen: Layout, hw: Hardware) -> float:
    """Training layout -> generation layout on the same devices: every device all-gathers its
    generation share of the bf16 weights from the training shards across the whole group."""
    world = train.world_size
    return comm.gather_or_scatter(hw, world, world, mem.PARAM_B * mem.params_per_device(shape, gen))


def price(plan: Plan, models: dict[str, ModelShape | None], wl: Workload, hw: Hardware,
          gen_layout: Layout | None = None, offline: bool = False) -> Priced:
    """Predict one RL step of `plan`; `models` maps each role the algorithm needs to its shape.
    The groups, which stages each runs and which weights each holds come from
    `plan.device_groups`, the same mapping the runtime starts its groups from.
    `gen_layout` is the generation layout, when not already in the plan.
    A colocated actor generates on its own copy, resharded every step, where the runtime
    makes one (`plan.needs_generation_copy`).
    Offline (DPO) steps generate nothing: the workload's K samples are the chosen and rejected
    responses, scored by the reference and trained on."""
    if gen_layout is not None:
        plan = plan.model_copy(update={"layouts": {**plan.layouts, "generation": gen_layout}})
    shared = plan.actor_critic == "shared"
    active = {r: m for r, m in models.items() if m is not None and not (shared and r == "critic")}
    groups = {g.name: g for g in device_groups(plan, tuple(active))}
    gen_g, ass_g, train_g = (stage_group(list(groups.values()), s).name for s in STAGES)
    actor = models["actor"]
    assert actor is not None
    train, gen = plan.layout("actor"), generation_layout(plan)
    apart = gen_g != train_g  # generation on a group of its own, fed by weight sync
    # samples of older weights, or partial rollouts' tokens of older weights: corrected
    stale = (plan.schedule == "async" and plan.staleness > 0) or wl.carries
    hybrid = not apart and needs_generation_copy(train, gen)  # the runtime's rule
    problems = placement_problems(plan, tuple(active))

    def layout_of(g: str, role: str) -> Layout:
        return model_layout(plan, groups[g], role)

    usable = hw.mem_bytes * mem.USABLE
    resident: dict[str, float] = {}
    host: dict[str, float] = {}
    for name, g in groups.items():
        resident[name] = host[name] = 0.0
        for role in g.models:
            if role == "actor" and not g.runs("training"):
                # async: the shadow copy receives the next weights while generation reads one
                copies = 2 if plan.schedule == "async" else 1
                resident[name] += copies * mem.PARAM_B * mem.params_per_device(actor, gen)
            elif role == "reference" and wl.lora_rank and g.runs("training"):
                pass  # the runtime's rule: the trained LoRA actor, adapters off, is the reference
            else:
                device, on_host = resident_bytes(
                    active[role], layout_of(name, role), hw,
                    role in TRAINABLE and g.runs("training"),
                    wl.lora_rank if role == "actor" else 0)
                resident[name] += device
                host[name] += on_host
    for name, nbytes in host.items():
        if not host_fits(nbytes, hw):
            problems.append(f"group {name}: offloaded model state needs {nbytes / GIB:.1f} GiB "
                            f"of host memory per device, the host has {hw.host_mem_gib:g}; "
                            "offload fewer models or use more devices")

    stages: list[StageCost] = []
    peak: dict[str, float] = dict(resident)
    # ZeRO-3 gathers full weights to generate; a hybrid layout holds a generation copy
    extra = mem.PARAM_B * mem.params_per_device(actor, gen) if not apart and \
        (train.zero == 3 or hybrid) else 0.0
    g_cost = cost.skipped("generation", "actor") if offline else \
        cost.generation(actor, gen, wl, hw, usable - resident[gen_g] - extra)
    stages.append(g_cost)
    where = {id(g_cost): gen_g}
    peak[gen_g] = max(peak[gen_g], resident[gen_g] + extra + g_cost.transient_bytes)
    if g_cost.seconds == float("inf"):
        problems.append(f"generation: one rollout's KV cache ({g_cost.transient_bytes / GIB:.1f}"
                        f" GiB per device) does not fit next to {resident[gen_g] / GIB:.1f}"
                        f" GiB of model state; the device has {hw.mem_gib:g} GiB")

    for role, shape in active.items():
        if role in ("reference", "reward") or (role == "critic" and not shared):
            # rewards are scored as samples finish, beside generation; the runtime's shared
            # prompt pass serves log-probs, not value or reward heads
            g = gen_g if role == "reward" else ass_g
            # a LoRA actor scores as the reference beside its training, in its own layout
            shares = role == "reference" and wl.lora_rank and groups[g].runs("training")
            st = cost.forward(shape, train if shares else layout_of(g, role), wl, hw, role,
                              role == "reference",
                              prompts_once=role == "reference",
                              trained=role in TRAINABLE and groups[g].runs("training"))
            stages.append(st)
            where[id(st)] = g
        proximal = stale and wl.policy_loss in DECOUPLED_LOSSES
        if role == "actor" and (proximal or wl.recompute_logprobs):
            # the proximal log-probs of the decoupled correction (runtime: hosts.decoupled),
            # or a peer's recomputed old log-probs: a forward over every rollout in the
            # training layout before the update
            st = replace(cost.forward(shape, layout_of(train_g, role), wl, hw, role,
                                      trained=True), stage="training",
                         note="proximal" if proximal else "old log-probs")
            stages.append(st)
            where[id(st)] = train_g
        if role in TRAINABLE:
            st = cost.training(shape, layout_of(train_g, role), wl, hw, role, role == "actor",
                               prompts_once=role == "actor" and not shared)
            stages.append(st)
            where[id(st)] = train_g
    for st in stages[1:]:
        g = where[id(st)]
        need = resident[g] + st.transient_bytes
        peak[g] = max(peak[g], need)
        if need > usable:
            problems.append(f"{st.role} {st.stage} needs {need / GIB:.1f} GiB per device, the "
                            f"device has {hw.mem_gib:g} ({usable / GIB:.1f} usable)")

    def per_group(stage: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for st in stages:
            if st.stage == stage:
                out[where[id(st)]] = out.get(where[id(st)], 0.0) + st.seconds
        return out

    g_s = g_cost.seconds
    a_by, t_by = per_group("assessment"), per_group("training")
    a_s, t_s = sum(a_by.values()), sum(t_by.values())
    sync_s = 0.0
    # the runtime broadcasts whole weights from training rank 0 to every rank of a copy's
    # group (runtime/executor/weight_channel.py); each rank keeps its shard
    if apart:  # a LoRA actor's copy receives the adapters alone
        synced = actor.lora_params(wl.lora_rank) if wl.lora_rank else actor.params
        sync_s = comm.broadcast_between_groups(hw, mem.PARAM_B * synced)
    elif hybrid:
        sync_s = reshard_seconds(actor, train, gen, hw)
    if "critic" in active and ass_g != train_g:  # the assessment group's critic copy
        sync_s += comm.broadcast_between_groups(hw, mem.PARAM_B * active["critic"].params)
    if plan.schedule == "async" and plan.staleness > 0 and apart:
        # generation (and the assessment beside it) of later steps runs while this one trains
        busy_train = max(t_by.get(g, 0.0) + a_by.get(g, 0.0) for g in t_by) if t_by else 0.0
        step = max(g_s + a_s, t_s, busy_train) + sync_s
    elif plan.schedule == "fused" and ass_g != gen_g:
        beside_gen = a_by.get(gen_g, 0.0)  # a reward model scores as samples finish
        step = max(g_s + beside_gen, a_s - beside_gen) + t_s + sync_s
    else:  # sync, or generation and training taking turns on one group
        step = g_s + a_s + t_s + sync_s
    devices = sum(g.ranks for g in groups.values())
    return Priced(plan, gen_layout, devices, step, g_s, a_s, t_s, sync_s, stages,
                  {g: b / GIB for g, b in peak.items()}, wl,
                  [where[id(st)] for st in stages], problems)
