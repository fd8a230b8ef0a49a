"""The Plan: where each role runs and how it is parallelised. Shared by runtime/ and perf/.

This file imports neither torch nor Ray, so the performance model can read plans instantly.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# "rollout" is the actor's generation layout when it differs from its training layout (a
# hybrid layout, or the separate generation group of an asynchronous plan).
Role = Literal["actor", "reference", "reward", "critic", "rollout"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Layout(Strict):
    """Intra-model parallel degrees of one role in one stage."""
    dp: int = Field(1, ge=1, description="data-parallel degree")
    tp: int = Field(1, ge=1, description="tensor-parallel degree")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree")
    cp: int = Field(1, ge=1, description="context-parallel degree")
    ep: int = Field(1, ge=1, description="expert-parallel degree")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage of data-parallel sharding")
    activation_checkpointing: bool = Field(False, description="recompute layer activations")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class Plan(Strict):
    """Placement, per-role layouts and schedule of one run."""
    placement: Literal["colocated", "interleaved", "disaggregated"] = Field(
        "colocated", description="whether roles share devices (colocated) or not")
    schedule: Literal["sync", "fused", "async"] = Field(
        "sync", description="barriers between stages, streamed stages, or bounded staleness")
    staleness: int = Field(0, ge=0, description="max weight versions generation may lag (async)")
    actor_critic: Literal["separate", "shared"] = Field(
        "separate", description="critic as its own model, or a value head on the actor's backbone")
    layouts: dict[Role, Layout] = Field(default_factory=dict,
                                        description="per-role layout; missing roles use 1 device")

    @model_validator(mode="after")
    def _staleness_needs_async(self) -> "Plan":
        if self.staleness and self.schedule != "async":
            raise ValueError(f"plan.staleness={self.staleness} needs plan.schedule=async")
        return self

    def layout(self, role: Role) -> Layout:
        return self.layouts.get(role, Layout())

    def single_process_problems(self) -> list[str]:
        """Why this plan cannot run in one process (empty when it can)."""
        problems = []
        if self.placement != "colocated":
            problems.append(f"plan.placement={self.placement} (use colocated)")
        if self.schedule != "sync":
            problems.append(f"plan.schedule={self.schedule} (use sync)")
        for role, layout in self.layouts.items():
            if layout.world_size != 1 or layout.ep != 1 or layout.zero:
                problems.append(f"plan.layouts.{role} asks for {layout.world_size} devices")
        return problems
