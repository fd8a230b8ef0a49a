"""Algorithm presets: which roles an algorithm needs and how it differs from the base settings
in `rlloom.config.AlgoSection`. Pure data (no torch), so `rlloom plan` can read it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    roles: tuple[str, ...]
    summary: str
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def online(self) -> bool:
        return "reward" in self.roles


# Losses whose stale samples (async, staleness > 0) the trainer corrects as decoupled PPO:
# it recomputes the actor's log-probs over every rollout before the update (the proximal
# policy), a forward the cost model prices (`perf.model.compose.price`).
DECOUPLED_LOSSES = ("ppo", "decoupled_ppo")

ONLINE = ("actor", "reference", "reward")
# Presets whose default KL coefficient is 0 need no reference model.
NO_REFERENCE = ("actor", "reward")

PRESETS: dict[str, Preset] = {
    "grpo": Preset(ONLINE, "group-normalised advantages, PPO clip, k3 KL in the loss "
                   "(Shao et al. 2024)"),
    "dr_grpo": Preset(NO_REFERENCE, "GRPO without std division or length normalisation "
                      "(Liu et al. 2025)",
                      {"advantage": "dr_grpo", "loss_agg": "seq-mean-token-sum-norm",
                       "kl_coef": 0.0}),
    "dapo": Preset(NO_REFERENCE, "clip-higher, token-mean, dynamic sampling, soft overlong penalty "
                   "(Yu et al. 2025)",
                   {"clip_high": 0.28, "loss_agg": "token-mean", "kl_coef": 0.0,
                    "dynamic_sampling": True, "overlong": "penalty"}),
    "rloo": Preset(ONLINE, "REINFORCE with a leave-one-out baseline, KL in the reward "
                   "(Ahmadian et al. 2024)",
                   {"advantage": "rloo", "policy_loss": "reinforce", "kl_in_reward": True,
                    "kl_estimator": "k1", "epochs": 1, "minibatches": 1}),
    "reinforce_pp": Preset(ONLINE, "discounted returns whitened over the batch, PPO clip, KL in "
                           "the reward (Hu 2025)",
                           {"advantage": "reinforce_pp", "kl_in_reward": True,
                            "kl_estimator": "k1", "loss_agg": "token-mean"}),
    "remax": Preset(ONLINE, "REINFORCE with the greedy rollout's reward as baseline "
                    "(Li et al. 2023)",
                    {"advantage": "remax", "policy_loss": "reinforce", "kl_in_reward": True,
                     "kl_estimator": "k1", "epochs": 1, "minibatches": 1}),
    "gspo": Preset(NO_REFERENCE, "sequence-level importance ratio and clipping (Zheng et al. 2025)",
                   {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
                    "kl_coef": 0.0}),
    "cispo": Preset(NO_REFERENCE, "clipped, detached importance weight times log-prob "
                    "(MiniMax-M1 2025)",
                    {"policy_loss": "cispo", "loss_agg": "token-mean", "kl_coef": 0.0}),
    "ppo": Preset(ONLINE + ("critic",), "GAE with a learned critic, PPO clip, KL in the reward "
                  "(Schulman et al. 2017; Ouyang et al. 2022)",
                  {"advantage": "gae", "kl_in_reward": True, "kl_estimator": "k1",
                   "loss_agg": "token-mean"}),
    "dpo": Preset(("actor", "reference"), "offline preference optimisation, no generation "
                  "(Rafailov et al. 2023)", {"epochs": 1, "minibatches": 1}),
}
