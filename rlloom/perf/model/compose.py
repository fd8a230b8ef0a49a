"""Price a Plan: stage costs per role, memory per device group, and the step time composed by
placement and schedule (docs/performance-model.md's composition).

Groups are `plan.device_groups`: the runtime starts the same ones. Within a group stages run
one after another (sums); across groups they run concurrently (maxima), so colocated-sync is
the table's plain sum. Weights cross groups after every optimizer step: the actor's to a
generation group of its own, the critic's to an assessment group's copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlloom.algos.presets import DECOUPLED_LOSSES
from rlloom.perf.model import comm, cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.cost import StageCost
from rlloom.perf.model.hardware import GIB, Hardware
from rlloom.perf.model.model_state import host_fits, resident_bytes
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Workload
from rlloom.plan import (
    STAGES,
    TRAINABLE,
    DeviceGroup,
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
    call_s: dict[str, float]  # group -> the driver's round trip of one stage call to it
    problems: list[str] = field(default_factory=list)
    resident_gib: dict[str, float] = field(default_factory=dict)  # model state, by group

    @property
    def feasible(self) -> bool:
        return not self.problems

    @property
    def micro_batch(self) -> int:
        return self.workload.micro_batch

    def run_plan(self) -> Plan:
        """The plan as a run states it: the generation layout, when separate, in its layouts."""
        plan = self.plan.model_copy(deep=True)
        if self.gen_layout is not None:
            plan.layouts["generation"] = self.gen_layout
        return plan

    @property
    def micro_batch_tokens(self) -> int:
        """The priced micro-batch as the runtime's token budget: the workload's own budget when
        it was priced with one (a running run's: `micro_batch` then prices nothing), else
        `micro_batch` sequences at the longest context, so no micro-batch the runtime cuts
        holds more padded tokens."""
        if self.workload.micro_batch_tokens > 0:
            return self.workload.micro_batch_tokens
        return math.ceil(self.micro_batch * self.workload.max_context)


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
    return comm.Collective("all_gather", world, world,
                           mem.PARAM_B * mem.params_per_device(shape, gen)).seconds(hw)


@dataclass
class _Placement:
    """Where a plan's stages run: its groups, by name, and the layouts the runtime uses."""
    plan: Plan
    active: dict[str, ModelShape]  # the roles that hold a model of their own
    groups: dict[str, DeviceGroup]
    gen_g: str
    ass_g: str
    train_g: str
    train: Layout
    gen: Layout
    apart: bool  # generation on a group of its own, fed by weight sync
    hybrid: bool  # a colocated actor generating on a resharded copy (the runtime's rule)

    @classmethod
    def of(cls, plan: Plan, models: dict[str, ModelShape | None]) -> _Placement:
        shared = plan.actor_critic == "shared"
        active = {r: m for r, m in models.items()
                  if m is not None and not (shared and r == "critic")}
        groups = {g.name: g for g in device_groups(plan, tuple(active))}
        gen_g, ass_g, train_g = (stage_group(list(groups.values()), s).name for s in STAGES)
        train, gen = plan.layout("actor"), generation_layout(plan)
        return cls(plan, active, groups, gen_g, ass_g, train_g, train, gen,
                   gen_g != train_g, gen_g == train_g and needs_generation_copy(train, gen))

    def layout(self, group: str, role: str) -> Layout:
        return model_layout(self.plan, self.groups[group], role)


def _model_state(p: _Placement, wl: Workload, hw: Hardware
                 ) -> tuple[dict[str, float], list[str]]:
    """Bytes of model state each group's devices hold (weights, gradients, optimizer state,
    a generation copy), and the groups whose offloaded state the host cannot hold."""
    resident: dict[str, float] = {}
    problems = []
    for name, g in p.groups.items():
        resident[name] = host = 0.0
        for role in g.models:
            if role == "actor" and not g.runs("training"):
                # async: the shadow copy receives the next weights while generation reads one
                copies = 2 if p.plan.schedule == "async" else 1
                resident[name] += copies * mem.PARAM_B * mem.params_per_device(
                    p.active["actor"], p.gen)
            elif role == "reference" and wl.lora_rank and g.runs("training"):
                pass  # the runtime's rule: the trained LoRA actor, adapters off, is the reference
            else:
                device, on_host = resident_bytes(
                    p.active[role], p.layout(name, role), hw,
                    role in TRAINABLE and g.runs("training"),
                    wl.lora_rank if role == "actor" else 0)
                resident[name] += device
                host += on_host
        if not host_fits(host, hw):
            problems.append(f"group {name}: offloaded model state needs {host / GIB:.1f} GiB "
                            f"of host memory per device, the host has {hw.host_mem_gib:g}; "
                            "offload fewer models or use more devices")
    return resident, problems


def _generation(p: _Placement, wl: Workload, hw: Hardware, resident: float, offline: bool
                ) -> tuple[StageCost, float]:
    """Generation's cost, and the bytes a colocated actor adds to generate (ZeRO-3 gathers
    whole weights; a hybrid layout holds a generation copy)."""
    actor = p.active["actor"]
    # beside vLLM the copy is in host memory (`hosts.staging_device`): vLLM's own weights are
    # in the budget it is handed
    extra = mem.PARAM_B * mem.params_per_device(actor, p.gen) if not p.apart and \
        (p.train.zero == 3 or p.hybrid) and wl.engine != "vllm" else 0.0
    if offline:
        return cost.skipped("generation", "actor"), extra
    usable = hw.mem_bytes * mem.USABLE
    return cost.generation(actor, p.gen, wl, hw, usable - resident - extra), extra


def _scoring_and_training(p: _Placement, wl: Workload, hw: Hardware, stale: bool
                          ) -> list[tuple[str, StageCost]]:
    """(group, cost) of every forward and update after generation, in the runtime's order."""
    shared = p.plan.actor_critic == "shared"
    out = []
    for role, shape in p.active.items():
        if role in ("reference", "reward") or (role == "critic" and not shared):
            # rewards are scored as samples finish, beside generation; the runtime's shared
            # prompt pass serves log-probs, not value or reward heads
            g = p.gen_g if role == "reward" else p.ass_g
            # a LoRA actor scores as the reference beside its training, in its own layout
            shares = role == "reference" and wl.lora_rank and p.groups[g].runs("training")
            out.append((g, cost.forward(shape, p.train if shares else p.layout(g, role), wl, hw,
                                        role, role == "reference",
                                        prompts_once=role == "reference",
                                        trained=role in TRAINABLE and p.groups[g].runs(
                                            "training"))))
        proximal = stale and wl.policy_loss in DECOUPLED_LOSSES
        if role == "actor" and (proximal or wl.recompute_logprobs):
            # the proximal log-probs of the decoupled correction (runtime: corrections.decoupled),
            # or a peer's recomputed old log-probs: a forward over every rollout in the
            # training layout before the update
            out.append((p.train_g, replace(
                cost.forward(shape, p.layout(p.train_g, role), wl, hw, role, trained=True),
                stage="training", note="proximal" if proximal else "old log-probs")))
        if role in TRAINABLE:
            out.append((p.train_g, cost.training(shape, p.layout(p.train_g, role), wl, hw, role,
                                                 role == "actor",
                                                 prompts_once=role == "actor" and not shared
                                                 and not wl.routing_replay)))
    return out


def _sync_seconds(p: _Placement, wl: Workload, hw: Hardware) -> float:
    """Weights crossing groups after the update: the runtime broadcasts whole weights from
    training rank 0 to every rank of a copy's group (runtime/executor/weight_channel.py;
    each rank keeps its shard), or reshards a colocated actor's generation copy."""
    actor, seconds = p.active["actor"], 0.0
    if p.apart:  # a LoRA actor's copy receives the adapters alone
        synced = actor.lora_params(wl.lora_rank) if wl.lora_rank else actor.params
        seconds = (_whole_on_rank0_s(actor, p.layout(p.train_g, "actor"), hw, synced)
                   + comm.broadcast_between_groups(hw, mem.PARAM_B * synced))
    elif p.hybrid:
        seconds = reshard_seconds(actor, p.train, p.gen, hw)
    if "critic" in p.active and p.ass_g != p.train_g:  # the assessment group's critic copy
        critic = p.active["critic"]
        seconds += (_whole_on_rank0_s(critic, p.layout(p.train_g, "critic"), hw, critic.params)
                    + comm.broadcast_between_groups(hw, mem.PARAM_B * critic.params))
    return seconds


def _whole_on_rank0_s(shape: ModelShape, train: Layout, hw: Hardware, synced: float) -> float:
    """Before a broadcast the trainer's rank 0 gathers the whole fp32 model
    (`RankGroup.full_state`): FSDP's shards over dp (ZeRO 2-3), TP's over tp, into host
    memory, and the channel copies the `synced` weights back to the device in the copies'
    bf16 (`hosts.copy_dtype`)."""
    whole = 4 * shape.params
    gathers = [comm.Collective("all_gather", train.dp, train.world_size, whole / train.tp)
               ] if train.zero >= 2 else []
    gathers.append(comm.Collective("all_gather", train.tp, train.tp, whole))
    host = (whole + mem.PARAM_B * synced) / hw.host_link_bw if hw.host_link_bw > 0 else 0.0
    return comm.seconds(hw, gathers) + host


def _step_seconds(p: _Placement, g_s: float, a_by: dict[str, float], t_by: dict[str, float],
                  sync_s: float, call: dict[str, float]) -> float:
    """The step composed by schedule: stages on one group add up, groups overlap; each stage
    call on a chain adds the driver's round trip to its group (`call`), and a weight sync
    across groups one to the generation group."""
    a_s, t_s = sum(a_by.values()), sum(t_by.values())
    beside = sum(call[g] for g in a_by if g not in t_by)  # assessment off the trainers
    trainers = sum(call[g] for g in t_by) + sum(call[g] for g in a_by if g in t_by)
    synced = p.apart * call[p.gen_g]  # the weights' broadcast reaches the generation ranks
    if p.plan.schedule == "async" and p.plan.staleness > 0 and p.apart:
        # generation (and the assessment beside it) of later steps runs while this one trains
        busy_train = max(t_by.get(g, 0.0) + a_by.get(g, 0.0) for g in t_by) if t_by else 0.0
        return max(g_s + a_s + call[p.gen_g] + beside,
                   max(t_s, busy_train) + trainers + synced) + sync_s
    calls = call[p.gen_g] + beside + trainers + synced
    if p.plan.schedule == "fused" and p.ass_g != p.gen_g:
        beside_gen = a_by.get(p.gen_g, 0.0)  # a reward model scores as samples finish
        return max(g_s + beside_gen, a_s - beside_gen) + t_s + sync_s + calls
    return g_s + a_s + t_s + sync_s + calls  # sync, or generation and training taking turns


def group_ranks(plan: Plan, models: dict[str, ModelShape | None]) -> dict[str, int]:
    """The ranks of each device group `plan` runs `models` on."""
    return {name: g.ranks for name, g in _Placement.of(plan, models).groups.items()}


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
    p = _Placement.of(plan, models)
    problems = placement_problems(plan, tuple(p.active))
    resident, host_problems = _model_state(p, wl, hw)
    problems += host_problems
    usable = hw.mem_bytes * mem.USABLE
    g_cost, extra = _generation(p, wl, hw, resident[p.gen_g], offline)
    peak = dict(resident)
    peak[p.gen_g] = max(peak[p.gen_g], resident[p.gen_g] + extra + g_cost.transient_bytes)
    if g_cost.seconds == float("inf"):
        problems.append(f"generation: one rollout's KV cache ({g_cost.transient_bytes / GIB:.1f}"
                        f" GiB per device) does not fit next to {resident[p.gen_g] / GIB:.1f}"
                        f" GiB of model state; the device has {hw.mem_gib:g} GiB")
    # samples of older weights, or partial rollouts' tokens of older weights: corrected
    stale = (plan.schedule == "async" and plan.staleness > 0) or wl.carries
    later = _scoring_and_training(p, wl, hw, stale)
    by_stage: dict[str, dict[str, float]] = {"assessment": {}, "training": {}}
    for g, st in later:
        need = resident[g] + st.transient_bytes
        peak[g] = max(peak[g], need)
        if need > usable:
            problems.append(f"{st.role} {st.stage} needs {need / GIB:.1f} GiB per device, the "
                            f"device has {hw.mem_gib:g} ({usable / GIB:.1f} usable)")
        by_stage[st.stage][g] = by_stage[st.stage].get(g, 0.0) + st.seconds
    a_by, t_by = by_stage["assessment"], by_stage["training"]
    sync_s = _sync_seconds(p, wl, hw)
    # the driver calls each rank of a group in turn (`Hardware.call_s`)
    call = {name: hw.call_s * g.ranks for name, g in p.groups.items()}
    step = _step_seconds(p, g_cost.seconds, a_by, t_by, sync_s, call)
    devices = sum(g.ranks for g in p.groups.values())
    return Priced(plan, gen_layout, devices, step, g_cost.seconds, sum(a_by.values()),
                  sum(t_by.values()), sync_s, [g_cost] + [st for _, st in later],
                  {g: b / GIB for g, b in peak.items()}, wl,
                  [p.gen_g] + [g for g, _ in later], call, problems,
                  {g: b / GIB for g, b in resident.items()})
