"""The device groups of a run (`plan.device_groups` over the models it builds), what the step
loop can run over them and what each group restores from a checkpoint (imports no Ray)."""
from __future__ import annotations

import os

from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig
from rlloom.models.config import ModelConfig
from rlloom.parallel.mesh import layout_problems
from rlloom.plan import (
    DeviceGroup,
    device_groups,
    generation_layout,
    lora_problems,
    model_layout,
)
from rlloom.runtime.executor.interface import RunOptions


def run_models(cfg: RunConfig) -> tuple[str, ...]:
    """The models a run builds (roles of `plan.device_groups`)."""
    roles = PRESETS[cfg.algo.name].roles
    return (("actor",) + (("reference",) if cfg.needs_reference else ())
            + (("critic",) if "critic" in roles else ())
            + (("reward",) if cfg.reward.model_path else ()))


def group_specs(cfg: RunConfig) -> list[DeviceGroup]:
    return device_groups(cfg.plan, run_models(cfg))


def loop_problems(cfg: RunConfig, opts: RunOptions) -> list[str]:
    """Why the step loop cannot run this schedule over this plan's groups, whichever executor
    runs them (empty when it can)."""
    plan, problems = cfg.plan, []
    gen, train = generation_layout(plan), plan.layout("actor")
    b = cfg.train.prompts_per_step
    chunks = min(opts.fused_chunks, b) if plan.schedule == "fused" else 1
    if b // chunks < gen.dp:
        problems.append(f"{b // chunks} prompts per generation request do not give each of the "
                        f"{gen.dp} generation replicas one; raise train.prompts_per_step")
    rows = b * cfg.rollout.n_samples // cfg.algo.minibatches
    most = max(train.dp, plan.layouts.get("critic", train).dp)
    if rows < most:
        problems.append(f"mini-batches of {rows} rows do not give each of the {most} training "
                        "replicas one; lower algo.minibatches or raise the batch")
    if plan.schedule == "fused" and cfg.algo.dynamic_sampling:
        problems.append("plan.schedule=fused streams fixed chunks of prompts, but "
                        "algo.dynamic_sampling refills the batch from whole-batch rewards; "
                        "use plan.schedule=sync or async")
    if not PRESETS[cfg.algo.name].online and (plan.schedule != "sync"
                                              or plan.placement != "colocated"):
        problems.append(f"algo={cfg.algo.name} trains offline on preference pairs: its policy "
                        "and reference share one group with nothing to overlap; use "
                        "plan.placement=colocated and plan.schedule=sync")
    if opts.fused_chunks < 1:
        problems.append(f"fused chunks must be >= 1, got {opts.fused_chunks}")
    if cfg.model.lora is not None:
        problems += lora_problems({**plan.layouts, "generation": gen})
    return problems


def check_group_layouts(cfg: RunConfig, model: ModelConfig) -> None:
    """Refuse, before any group starts, a layout that does not fit the policy's architecture
    on its group's ranks (the reward model is scored data-parallel, whatever its shape)."""
    problems = []
    for g in group_specs(cfg):
        layouts = {m: model_layout(cfg.plan, g, m) for m in g.models if m != "reward"}
        if g.runs("generation") and g.runs("training"):
            layouts["generation"] = generation_layout(cfg.plan)
        for m, layout in layouts.items():
            problems += [f"group {g.name!r}, {m}: {p}"
                         for p in layout_problems(layout, model, g.ranks)]
    if problems:
        raise ConfigError("the plan's layouts do not fit the model: " + "; ".join(problems))


def needs_ray(cfg: RunConfig) -> bool:
    """Plans that only the Ray runtime executes (outside torchrun): placements other than
    colocated, and layouts over more than one device."""
    return bool(cfg.plan.single_process_problems()) and world_size() == 1


def world_size() -> int:
    """Processes `torchrun` started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def state_keys(stages: tuple[str, ...]) -> set[str]:
    """The checkpoint entries a group running `stages` restores."""
    keys = {"step"}
    if "training" in stages:
        keys |= {"policy", "optimizer", "shuffle_gen", "critic", "critic_optimizer"}
    if "generation" in stages:
        keys |= {"sample_gen", "sample_gens", "data_position", "partial_pool"}
    return keys
