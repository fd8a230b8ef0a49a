"""What the Ray runtime runs: its options, the device groups a plan's placement makes, and
the checks that refuse what it cannot run (imports neither Ray nor the workers' models)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rlloom.algos.presets import PRESETS
from rlloom.config import ConfigError, RunConfig
from rlloom.plan import Plan

STAGE_ROLES = ("generation", "assessment", "training")


@dataclass
class RayOptions:
    """How the Ray runtime runs (the plan says what runs where)."""
    address: str | None = None      # join this cluster ("auto", "host:6379"); None: start one
    worker_timeout_s: float = 600.0  # longest wait for any worker answer once started
    startup_timeout_s: float = 600.0  # longest wait for a group's resources and models
    max_restarts: int = 0           # times the driver may recreate the groups after a fault
    group_cpus: dict[str, float] = field(default_factory=dict)  # group -> CPUs (default 1)
    num_cpus: float | None = None   # CPUs of a started instance (default: cores or more)
    fused_chunks: int = 2           # generation requests per step of a fused schedule
    fault: str | None = None        # test hook "kill|stop:<group>:<step>", first attempt only

    def cpus(self, group: str) -> float:
        return float(self.group_cpus.get(group, 1.0))


@dataclass(frozen=True)
class GroupSpec:
    name: str
    roles: tuple[str, ...]  # stage roles hosted: generation, assessment, training


def group_specs(plan: Plan) -> list[GroupSpec]:
    if plan.placement == "colocated":
        return [GroupSpec("all", STAGE_ROLES)]
    if plan.placement == "interleaved":
        return [GroupSpec("trainable", ("generation", "training")),
                GroupSpec("frozen", ("assessment",))]
    return [GroupSpec("rollout", ("generation",)), GroupSpec("actor", ("training",)),
            GroupSpec("reference", ("assessment",))]


def ray_problems(cfg: RunConfig, opts: RayOptions) -> list[str]:
    """Why the Ray runtime cannot run this configuration (empty when it can)."""
    problems = []
    if not PRESETS[cfg.algo.name].online:
        problems.append(f"algo={cfg.algo.name} trains offline (no generation); run it with the "
                        "single-process runtime (plan.placement=colocated, plan.schedule=sync, "
                        "no --ray)")
    for role, layout in cfg.plan.layouts.items():
        if layout.world_size != 1 or layout.ep != 1 or layout.zero:
            problems.append(f"plan.layouts.{role} asks for {layout.world_size} devices "
                            f"(ep={layout.ep}, zero={layout.zero}); the Ray runtime runs one "
                            "process per role group: set the layout's degrees to 1 (parallel "
                            "layouts inside a role run under torchrun)")
    if cfg.train.device not in ("auto", "cpu"):
        problems.append(f"train.device={cfg.train.device}: the Ray runtime runs every role on "
                        "the CPU for now (GPUs are used in one process or under torchrun); "
                        "set train.device=cpu or auto")
    if cfg.plan.schedule == "fused" and cfg.algo.dynamic_sampling:
        problems.append("plan.schedule=fused streams fixed chunks of prompts, but "
                        "algo.dynamic_sampling refills the batch from whole-batch rewards; "
                        "use plan.schedule=sync or async")
    if opts.fused_chunks < 1:
        problems.append(f"fused chunks must be >= 1, got {opts.fused_chunks}")
    if opts.worker_timeout_s <= 0 or opts.max_restarts < 0:
        problems.append("--worker-timeout must be > 0 and --max-restarts >= 0")
    names = {g.name for g in group_specs(cfg.plan)}
    unknown = set(opts.group_cpus) - names
    if unknown:
        problems.append(f"CPUs given for groups {sorted(unknown)}; this plan's groups are "
                        f"{', '.join(sorted(names))}")
    if any(c <= 0 for c in opts.group_cpus.values()):
        problems.append("group CPUs must be > 0")
    return problems


def check_ray_runnable(cfg: RunConfig, opts: RayOptions) -> None:
    from rlloom.runtime.trainer import check_runnable
    problems = ray_problems(cfg, opts)
    if problems:
        raise ConfigError("the Ray runtime cannot run this configuration: " + "; ".join(problems))
    # the registry checks of the single-process runtime, for a plan it can run
    check_runnable(cfg.model_copy(update={"plan": Plan(actor_critic=cfg.plan.actor_critic)}))


def needs_ray(cfg: RunConfig) -> bool:
    """Plans that only the Ray runtime executes."""
    return cfg.plan.placement != "colocated" or cfg.plan.schedule != "sync"


def state_keys(roles: tuple[str, ...]) -> set[str]:
    """The checkpoint entries a group's roles restore."""
    keys = {"step"}
    if "training" in roles:
        keys |= {"policy", "optimizer", "shuffle_gen", "critic", "critic_optimizer"}
    if "generation" in roles:
        keys |= {"sample_gen", "data_position"}
    return keys
