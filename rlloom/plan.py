"""The Plan: where each role runs and how it is parallelised. Shared by runtime/ and perf/.

This file imports neither torch nor Ray, so the performance model can read plans instantly.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# "generation" is the actor's generation layout when it differs from its training layout (a
# hybrid layout, or the separate generation group of an asynchronous plan). Plans before
# 2026-12 called it "rollout", which still reads as "generation" (`Plan._old_names`).
Role = Literal["actor", "reference", "reward", "critic", "generation"]


class Strict(BaseModel):
    # NaN and inf are refused in every float field: none has a meaning for them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class Layout(Strict):
    """Intra-model parallel degrees of one role in one stage."""
    dp: int = Field(1, ge=1, description="data-parallel degree")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")
    cp: int = Field(1, ge=1, description="context-parallel degree")
    ep: int = Field(1, ge=1, description="expert-parallel degree")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage of data-parallel sharding")
    activation_checkpointing: bool = Field(False, description="recompute layer activations")
    offload: bool = Field(False, description="ZeRO-3's shards (parameters, gradients, "
                          "optimizer state) rest in host memory and the optimizer steps on "
                          "the CPU; each layer's shard is copied in as it is gathered (FSDP2's "
                          "CPUOffloadPolicy)")

    @model_validator(mode="after")
    def _offload_shards(self) -> "Layout":
        if self.offload and (self.zero != 3 or self.dp < 2):
            raise ValueError(f"offload: true with dp={self.dp} zero={self.zero}: offload moves "
                             "the shards of ZeRO-3 over dp ranks to host memory; set zero: 3 "
                             "and dp of at least 2, or offload: false")
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class Adapt(Strict):
    """Re-pricing the plan while the run goes (`runtime/executor/adapt.py`)."""
    every: int = Field(0, ge=0, description="every N steps, calibrate the cost model on the "
                       "run's measured stages, re-plan with the lengths of the last `window` "
                       "steps and log what a better plan on the same devices would gain "
                       "(adapt.jsonl), switching to it unless dry; 0: off")
    min_gain: float = Field(1.15, gt=1.0, description="the predicted speed-up a plan needs to "
                            "count as better")
    window: int = Field(8, ge=1, description="recent steps whose lengths and times are used")
    hardware: str = Field("local", description="the hardware file priced with: a catalogue "
                          "name, a file, or local (`rlloom bench hw`)")
    dry: bool = Field(True, description="only log the decision; false (Ray runs): switch to "
                      "the better plan, from a checkpoint of that step")


class Plan(Strict):
    """Placement, per-role layouts and schedule of one run."""
    placement: Literal["colocated", "interleaved", "disaggregated"] = Field(
        "colocated", description="whether roles share devices (colocated) or not")
    schedule: Literal["sync", "fused", "async"] = Field(
        "sync", description="barriers between stages, streamed stages, or bounded staleness")
    staleness: int = Field(0, ge=0, description="max weight versions generation may lag (async)")
    actor_critic: Literal["separate", "shared"] = Field(
        "separate", description="critic as its own model, or a value head on the actor's backbone")
    reference: Literal["apart", "with_actor"] = Field(
        "apart", description="disaggregated: the reference on a group of its own, or on the "
        "training group beside the actor (verl's one-step-off and NeMo RL's async layout)")
    layouts: dict[Role, Layout] = Field(default_factory=dict,
                                        description="per-role layout (actor, critic, reference, "
                                        "reward, and generation: the actor's layout for "
                                        "generation when it differs); missing roles use 1 "
                                        "device")
    adapt: Adapt = Field(default_factory=Adapt, description="re-pricing while the run goes")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """plan.layouts.rollout, the generation layout's old name, read as generation."""
        layouts = data.get("layouts") if isinstance(data, dict) else None
        if isinstance(layouts, dict) and "rollout" in layouts:
            if "generation" in layouts:
                raise ValueError("plan.layouts has both rollout and generation: they are one "
                                 "layout (rollout is its old name); keep generation")
            warnings.warn("plan.layouts.rollout is now plan.layouts.generation (the stage it "
                          "lays out); the old name still works", FutureWarning, stacklevel=2)
            data = {**data, "layouts": {("generation" if k == "rollout" else k): v
                                        for k, v in layouts.items()}}
        return data

    @model_validator(mode="after")
    def _staleness_needs_async(self) -> "Plan":
        if self.staleness and self.schedule != "async":
            raise ValueError(f"plan.staleness={self.staleness} needs plan.schedule=async")
        if self.reference == "with_actor" and self.placement != "disaggregated":
            raise ValueError("plan.reference=with_actor puts the reference on the training "
                             "group of a disaggregated plan; colocated already does, "
                             "interleaved keeps it apart: set plan.placement=disaggregated "
                             "or plan.reference=apart")
        return self

    def layout(self, role: Role) -> Layout:
        layout = self.layouts.get(role)  # a default built only when used: the planner asks often
        return layout if layout is not None else Layout()

    def single_process_problems(self) -> list[str]:
        """Why this plan cannot run in one process (empty when it can): one process is one
        colocated group of one rank, under any schedule."""
        problems = []
        if self.placement != "colocated":
            problems.append(f"plan.placement={self.placement} (use colocated)")
        for role, layout in self.layouts.items():
            if layout.world_size != 1 or layout.ep != 1 or layout.zero:
                problems.append(f"plan.layouts.{role} asks for {layout.world_size} devices")
        return problems


# -- where each stage runs: one mapping for the runtime and the performance model -------------

STAGES = ("generation", "assessment", "training")
TRAINABLE = ("actor", "critic")


@dataclass(frozen=True)
class DeviceGroup:
    """Ranks that run some stages of a step and hold some models' weights.

    `models` are the roles whose weights live here: trained ones on the training group, the
    reference, a reward model (scored as samples finish, so beside generation) and copies:
    the actor's generation copy on a group that generates but does not train, the critic's
    copy on an assessment group that does not train (it scores values for advantages)."""
    name: str
    stages: tuple[str, ...]
    models: tuple[str, ...]
    ranks: int

    def runs(self, stage: str) -> bool:
        return stage in self.stages


def device_groups(plan: Plan, models: tuple[str, ...]) -> list[DeviceGroup]:
    """The device groups `plan` puts the run's `models` (roles among actor, reference, reward,
    critic that the run builds) on, in order of the stages they first run.

    | placement     | groups: stages                                                         |
    |---------------|------------------------------------------------------------------------|
    | colocated     | all: generation, assessment, training                                  |
    | interleaved   | trainable: generation, training (+ assessment without a reference);    |
    |               | frozen: assessment                                                     |
    | disaggregated | generation: generation; actor: training (+ assessment without a        |
    |               | reference, or with plan.reference=with_actor); reference: assessment   |

    A shared actor-critic has no critic model (its value head rides on the actor). The critic
    always trains with the actor, in the actor's layout."""
    critic = "critic" in models and plan.actor_critic == "separate"
    reward = ("reward",) if "reward" in models else ()
    frozen = "reference" in models
    train_ranks = plan.layout("actor").world_size
    gen_ranks = generation_layout(plan).world_size
    trained = ("actor",) + (("critic",) if critic else ())
    if plan.placement == "colocated":
        held = trained + (("reference",) if frozen else ()) + reward
        return [DeviceGroup("all", STAGES, held, train_ranks)]
    scorer = ("reference",) + (("critic",) if critic else ())  # critic: a synced copy
    if plan.placement == "interleaved":
        trainable = DeviceGroup("trainable", ("generation", "training") if frozen else STAGES,
                                trained + reward, train_ranks)
        return [trainable] + ([DeviceGroup("frozen", ("assessment",), scorer,
                                           plan.layout("reference").world_size)]
                              if frozen else [])
    beside = frozen and plan.reference == "with_actor"
    actor = DeviceGroup("actor", ("training",) if frozen and not beside
                        else ("assessment", "training"),
                        trained + (("reference",) if beside else ()), train_ranks)
    groups = [DeviceGroup("generation", ("generation",), ("actor",) + reward, gen_ranks),
              actor]
    if frozen and not beside:
        groups.append(DeviceGroup("reference", ("assessment",), scorer,
                                  plan.layout("reference").world_size))
    return groups


def stage_group(groups: list[DeviceGroup], stage: str) -> DeviceGroup:
    return next(g for g in groups if g.runs(stage))


def model_layout(plan: Plan, group: DeviceGroup, model: str) -> Layout:
    """The layout `model` has on `group`. Generation runs in the "generation" layout when the plan
    gives one, else the actor's; a critic that trains takes its own layout or the actor's; a
    model the plan gives no layout runs data-parallel over the group's ranks."""
    if model == "actor" and not group.runs("training"):
        return generation_layout(plan)
    if model == "critic" and group.runs("training"):
        return plan.layouts.get("critic", plan.layout("actor"))
    if model == "critic":  # the assessment group's copy scores like the reference beside it
        model = "reference"
    layout = plan.layouts.get(model)  # as in Plan.layout
    return layout if layout is not None else Layout(dp=group.ranks)


def generation_layout(plan: Plan) -> Layout:
    """The layout generation runs in: the plan's "generation" layout, else the actor's, with
    pipeline stages as data-parallel replicas and every expert on each rank (decoding runs on
    whole copies: each rank of a pipeline samples its own prompts instead of holding some
    layers)."""
    layout = plan.layouts.get("generation", plan.layout("actor"))
    if layout.pp > 1 or layout.ep > 1:
        layout = layout.model_copy(update={"dp": layout.dp * layout.pp, "pp": 1, "ep": 1})
    return layout


def needs_generation_copy(train: Layout, gen: Layout) -> bool:
    """Whether an actor that trains and generates on the same ranks generates on its own copy,
    resharded from the trained weights after every step (the runtime builds it, the cost
    model prices it): on more than one rank, when generation uses another layout, when
    training is data-parallel (replicas decode different prompts for different numbers of
    steps, so their forwards must not need each other: ZeRO gathers would deadlock), on
    sequence shards (a KV cache cannot decode them) or in pipeline stages (each holds only
    some layers)."""
    return train.world_size > 1 and (gen != train or train.dp > 1 or train.cp > 1
                                     or train.pp > 1)


def placement_problems(plan: Plan, models: tuple[str, ...]) -> list[str]:
    """Why the plan's layouts do not fit its device groups (empty when they do): every model
    on a group uses all of the group's ranks."""
    problems = []
    for g in device_groups(plan, models):
        for model in g.models:
            got = model_layout(plan, g, model).world_size
            if got != g.ranks:
                key = "generation" if model == "actor" and not g.runs("training") else model
                problems.append(f"plan.layouts.{key} uses {got} ranks but group {g.name!r} has "
                                f"{g.ranks} (set by plan.layouts.{_sizer(plan, g)}); make "
                                f"dp x tp x pp x cp = {g.ranks}")
    return problems


def _sizer(plan: Plan, group: DeviceGroup) -> str:
    if group.runs("training"):
        return "actor"
    return "generation" if group.runs("generation") and "generation" in plan.layouts else (
        "actor" if group.runs("generation") else "reference")


# -- what the executor runs: the one capability table `rlloom plan` and `rlloom train` read ----

def lora_problems(layouts: dict[str, Layout]) -> list[str]:
    """Why LoRA adapters cannot train over these layouts (empty when they can): they are not
    split by tensor, pipeline or expert parallelism. The runtime and the planner both ask."""
    sharded = sorted(role for role, x in layouts.items() if x.tp > 1 or x.pp > 1 or x.ep > 1)
    if not sharded:
        return []
    return [f"model.lora: the layouts of {', '.join(sharded)} shard weights by tensor, "
            "pipeline or expert parallelism, which LoRA adapters are not split by; use dp "
            "(with any ZeRO stage) and cp there"]


def engine_problems(engine: str, plan: Plan, latent: bool = False) -> list[str]:
    """Why `rollout.engine` cannot generate in the plan's generation layout (empty when it
    can): vLLM's server holds a whole copy of the policy per generation replica, and does
    not serve latent attention (`latent`: DeepSeek-V3) as the trainer scores it. The
    runtime and the planner both ask."""
    problems = []
    if engine == "vllm" and generation_layout(plan).tp > 1:
        problems.append("rollout.engine=vllm runs whole copies of the policy; a "
                        "tensor-parallel generation layout runs on rlloom's engine: set the "
                        "generation (or actor) layout's tp=1, or rollout.engine=rlloom")
    if engine == "vllm" and latent:
        problems.append("rollout.engine=vllm does not serve latent attention (DeepSeek-V3) "
                        "yet: vLLM's log-probs of its samples did not match the trainer's in "
                        "rlloom's check; generate with rollout.engine=rlloom")
    return problems


def unsplit_degrees(latent: bool, shared_experts: bool) -> dict[str, str]:
    """The degrees (layout fields) that must stay 1 for a model whose blocks the executor
    does not split that way yet, each with why: the planner offers none of them, a layout
    that sets one is refused. `latent`: DeepSeek-V3's latent attention; `shared_experts`:
    its experts every token runs (expert parallelism keeps them on every rank)."""
    if not (latent or shared_experts):
        return {}
    block = "latent attention" if latent else "shared experts"
    return {"tp": f"tensor parallelism does not shard {block} (DeepSeek-V3) yet"}


def runnable_problems(plan: Plan, models: tuple[str, ...]) -> list[str]:
    """Why the executor cannot run this plan's placement and layouts (empty when it can)."""
    problems = placement_problems(plan, models)
    for role, layout in plan.layouts.items():
        if layout.ep > 1 and (role not in TRAINABLE or layout.dp % layout.ep):
            problems.append(f"plan.layouts.{role}.ep={layout.ep}: the executor spreads the "
                            "experts of a model that trains (actor, critic) over groups of its "
                            "dp ranks (with tp, cp and pp or not): an ep dividing dp; change it "
                            "(`rlloom plan --price-only` prices such plans without running "
                            "them)")
        if layout.cp > 1 and role not in TRAINABLE + ("reference",):
            problems.append(f"plan.layouts.{role}.cp={layout.cp}: context parallelism shards "
                            "the sequences of teacher-forced passes (actor, critic, reference), "
                            "not generation's; set cp=1 here")
        if layout.pp > 1 and role not in TRAINABLE + ("reference",):
            problems.append(f"plan.layouts.{role}.pp={layout.pp}: pipeline stages (with tp "
                            "and cp or not) run the actor (a shared actor-critic too), a "
                            "separate critic and the reference (with a critic copy beside "
                            "it); set pp=1 here")
    generation = plan.layouts.get("generation")
    if generation is not None and generation.zero:
        problems.append(f"plan.layouts.generation.zero={generation.zero}: a generation "
                        "layout holds no optimizer state and its replicas decode for different "
                        "numbers of steps, so it is not sharded over dp; set zero=0")
    return problems
