"""What a run gives the registered functions its `algo` section names, checked before any work.

Each estimator or loss declares its needs where it is registered (`Registry.register(name,
needs=...)`); `algo_problems` compares them with what the runtimes (one process, torchrun,
Ray) provide for the configuration, so an impossible combination fails before a model loads.
"""
from __future__ import annotations

from rlloom.algos.advantages import ADVANTAGES
from rlloom.algos.aggregation import AGGREGATIONS
from rlloom.algos.kl import KL_ESTIMATORS
from rlloom.algos.policy_losses import POLICY_LOSSES
from rlloom.algos.presets import PRESETS
from rlloom.algos.registry import NEEDS, Registry
from rlloom.config import RunConfig

# needs that only a role of the preset provides: need -> that role
ROLE_NEEDS = {"critic": "critic"}
# needs every runtime provides for any online preset:
# - greedy_baseline: one greedy rollout per prompt (generation.greedy_baseline); the runtimes run it
#   when algo.advantage is remax, its only user today.
# - prox_logp: in one process, under torchrun and on Ray at staleness 0 the samples come from
#   the weights being trained, so the proximal policy is the behaviour policy and its
#   log-probs are the rollout's; a stale Ray step computes them (corrections.decoupled).
ALWAYS = frozenset({"greedy_baseline", "prox_logp"})


def provided(cfg: RunConfig) -> frozenset[str]:
    """The needs a run of `cfg` satisfies."""
    roles = PRESETS[cfg.algo.name].roles
    return ALWAYS | {need for need, role in ROLE_NEEDS.items() if role in roles}


def _missing(key: str, name: str, need: str, registry: Registry, cfg: RunConfig) -> str:
    role = ROLE_NEEDS[need]
    presets = [p for p, preset in PRESETS.items() if role in preset.roles]
    others = [n for n in registry.names() if need not in registry.needs(n)]
    preset = cfg.algo.name
    return (f"{key}={name} needs {need} ({NEEDS[need]}), but preset algo={preset} has no "
            f"{role} role (roles: {', '.join(PRESETS[preset].roles)}); set algo="
            f"{' or algo='.join(presets)}, or set {key} to one without that need: "
            f"{', '.join(others)}")


def algo_problems(cfg: RunConfig) -> list[str]:
    """Why the `algo` section of `cfg` cannot run, one line per problem (empty: it can)."""
    a = cfg.algo
    named = [("algo.advantage", ADVANTAGES, a.advantage),
             ("algo.policy_loss", POLICY_LOSSES, a.policy_loss),
             ("algo.loss_agg", AGGREGATIONS, a.loss_agg),
             ("algo.kl_estimator", KL_ESTIMATORS, a.kl_estimator)]
    problems = []
    have = provided(cfg)
    for key, registry, name in named:
        if name not in registry.names():
            problems.append(f"{key}={name!r} is not registered; choose one of "
                            f"{', '.join(registry.names())}")
        # an offline preset (dpo) runs none of these, so their needs do not apply
        elif PRESETS[a.name].online:
            problems += [_missing(key, name, need, registry, cfg)
                         for need in sorted(registry.needs(name) - have)]
    return problems
