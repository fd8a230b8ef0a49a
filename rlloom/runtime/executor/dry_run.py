"""`rlloom train --dry-run`: everything `rlloom train` checks before it starts, and the plan's
device groups, resources and memory per device, without building or running anything."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from rlloom.config import ConfigError, RunConfig
from rlloom.models.config import ModelConfig
from rlloom.models.hf_io import read_model_config
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.parallel.mesh import layout_summary
from rlloom.perf.model.compose import Priced, price, role_models
from rlloom.perf.model.hardware import Hardware, hardware
from rlloom.perf.model.memory import USABLE
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.validation.validate import critic_shape, run_roles
from rlloom.plan import generation_layout, model_layout
from rlloom.runtime.default_model import tiny_model_config
from rlloom.runtime.executor.groups import check_group_layouts, group_specs, needs_ray
from rlloom.runtime.executor.interface import RunOptions
from rlloom.runtime.executor.preflight import preflight


def _architecture(cfg: RunConfig) -> ModelConfig:
    if cfg.model.path:
        return read_model_config(Path(cfg.model.path))
    return tiny_model_config(cfg.model, len(build_char_tokenizer()))  # the built-in model, unbuilt


def dry_run(cfg: RunConfig, hardware_name: str | None, opts: RunOptions | None = None,
            rehearse: bool = False) -> str:
    """The checks' verdict and what the run would use; raises ConfigError on a problem.
    `hardware_name` prices memory per device (worst case: every prompt at
    data.max_prompt_tokens, every response at rollout.max_new_tokens). `rehearse`: the
    actor's training micro-batch (as many such rows as train.micro_batch_tokens holds) is
    rehearsed too, and the training group's peak raised by what it measures above the
    price."""
    opts = opts or RunOptions()
    on_ray = needs_ray(cfg)
    preflight(cfg, "ray" if on_ray else "process", opts)
    model = _architecture(cfg)
    check_group_layouts(cfg, model)
    groups = group_specs(cfg)
    lines = [f"runs {'on Ray' if on_ray else 'in one process'}: "
             + ", ".join(f"{g.name} ({g.ranks} ranks)" for g in groups)]
    for g in groups:
        models = [f"{m} {layout_summary(model_layout(cfg.plan, g, m))}" for m in g.models]
        if g.runs("generation") and g.runs("training"):
            models.append(f"generation {layout_summary(generation_layout(cfg.plan))}")
        lines.append(f"  {g.name}: {', '.join(g.stages)}; " + "; ".join(models))
    ranks = sum(g.ranks for g in groups)
    cpus = sum(opts.cpus(g.name) * g.ranks for g in groups)
    gpu = cfg.train.device != "cpu"
    lines.append(f"resources: {ranks} ranks, {cpus:g} CPUs"
                 + (f" and, on a cluster with GPUs, {ranks} GPUs (one per rank)" if gpu else ""))
    if hardware_name is None:
        lines.append("memory: not checked (give --hardware NAME, e.g. h100 or local)")
        return "\n".join(lines)
    try:
        hw = hardware(hardware_name)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    shape = ModelShape.from_hf_config(model.to_hf(), "policy")
    wl = Workload(cfg.train.prompts_per_step, cfg.rollout.n_samples, cfg.data.max_prompt_tokens,
                  Lengths("fixed", cfg.rollout.max_new_tokens), ppo_epochs=cfg.algo.epochs,
                  minibatches=cfg.algo.minibatches,
                  dtype="bf16" if cfg.model.dtype == "bfloat16" else "fp32",
                  micro_batch_tokens=cfg.train.micro_batch_tokens,
                  max_batch=cfg.rollout.max_batch, policy_loss=cfg.algo.policy_loss,
                  partial_tokens=cfg.rollout.partial_tokens, lora_rank=cfg.lora_rank,
                  turns=cfg.rollout.max_turns,
                  routing_replay=cfg.algo.routing_replay == "replay")
    priced = price(cfg.plan, role_models(shape, run_roles(cfg), critic=critic_shape(cfg.model)), wl,
                   hw)
    lines.append(f"memory per device on {hw.name} ({hw.mem_gib:g} GiB): "
                 + ", ".join(f"{g} {gib:.2f} GiB" for g, gib in sorted(priced.mem_gib.items()))
                 + f"; predicted step {priced.step_s:.3g} s")
    if priced.problems:
        raise ConfigError("the plan does not fit: " + "; ".join(priced.problems))
    if rehearse:
        lines.append(_rehearsed(priced, shape, hw))
    return "\n".join(lines)


def _rehearsed(priced: Priced, shape: ModelShape, hw: Hardware) -> str:
    from rlloom.rehearsal.plans import rehearse_plan
    wl = priced.workload
    rows = max(1, wl.micro_batch_tokens // math.ceil(wl.max_context))
    r = rehearse_plan(replace(priced, workload=replace(wl, micro_batch=rows)), shape)
    said = (f"rehearsal: actor training {r.rehearsed_gib:.2f} GiB per device (priced "
            f"{r.model_gib:.2f}) for {r.rows} rows of {r.prompt} + {r.response} tokens; "
            f"training group {r.group_gib:.2f} GiB")
    if not r.fits(hw):
        raise ConfigError(f"{said}: over the {hw.mem_gib * USABLE:.1f} GiB usable on "
                          f"{hw.name}; lower train.micro_batch_tokens, turn on "
                          "plan.layouts.actor.activation_checkpointing, or shard more "
                          "(plan.layouts.actor.zero=3, more dp or tp)")
    return said
