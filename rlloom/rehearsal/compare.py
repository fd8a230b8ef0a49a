"""The cost model's prediction for one rank's training micro-batch, or its generation, beside
its rehearsal."""
from __future__ import annotations

import yaml
from pydantic import ValidationError

from rlloom.config import ConfigError
from rlloom.perf.model import comm, cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout
from rlloom.rehearsal.generation import rehearse_generation
from rlloom.rehearsal.train import rehearse_training

def predicted_training(shape: ModelShape, layout: Layout, rows: int, prompt: int,
                       response: int, lora_rank: int = 0) -> dict[str, float]:
    """What the cost model charges one rank for this micro-batch, by kind: the resident
    state (`memory.model_state_bytes`, split into its parts at the model's precision),
    `cost.training`'s transient bytes and FLOPs for a step of exactly this micro-batch, and
    the bytes it sends in that step's collectives (`comm.training`)."""
    wl = Workload(prompts=rows * layout.dp, samples=1, prompt_len=prompt,
                  response=Lengths("fixed", response), micro_batch=rows, lora_rank=lora_rank)
    hw = hardware("h100")
    stage = cost.training(shape, layout, wl, hw, "actor")
    param, grad, optim = mem.TRAINED_STATE
    parts = {kind: mem.model_state_bytes(shape, layout, True, only, lora_rank)
             for kind, only in (
        ("params", (param, 0, 0)), ("grads", (0, grad, 0)), ("optimizer", (0, 0, optim)))}
    # the stage's transient is net of the gradients (`memory.training_transient_bytes`)
    parts["transient"] = stage.transient_bytes + parts["grads"]
    parts["peak"] = parts["params"] + parts["optimizer"] + parts["transient"]
    parts["flops"] = stage.compute_s * hw.flops(wl.dtype)  # the busiest device's
    step = comm.training(shape, layout, wl, "actor")
    parts["sent"] = comm.sent(step["model"] + step["dp"])
    return parts


def compare_training(shape: ModelShape, layout: Layout, rows: int, prompt: int,
                     response: int, lora_rank: int = 0) -> dict[str, dict[str, float]]:
    """{kind: {model, rehearsed, ratio}} for `train.rehearsed_rank` (ratio = model /
    rehearsed)."""
    model = predicted_training(shape, layout, rows, prompt, response, lora_rank)
    r = rehearse_training(shape, layout, rows, prompt, response, lora_rank)
    measured = {"params": r.params, "grads": r.grads, "optimizer": r.optimizer,
                # what the step adds to weights and AdamW state at its peak, as the model's
                "transient": r.peak - r.params - r.optimizer, "peak": r.peak, "flops": r.flops,
                "sent": sum(r.sent.values())}
    return _side_by_side(model, measured)


def predicted_generation(shape: ModelShape, tp: int, slots: int, rollouts: int, prompt: int,
                         response: int, samples: int) -> dict[str, float]:
    """What the cost model charges one generation rank: bf16 weights, `slots` rollouts' KV
    cache at the longest context, and the engine's working memory (`cost.generation`'s
    own terms)."""
    layout = Layout(tp=tp)
    plain = cost.plain_loop(layout, Workload(), shape)
    parts = {"weights": mem.PARAM_B * mem.params_per_device(shape, layout),
             "kv": slots * mem.kv_bytes_per_rollout(shape, layout, prompt + response),
             "transient": mem.generation_transient_bytes(shape, tp, slots, prompt, samples,
                                                         plain, rollouts, response)}
    return {**parts, "peak": sum(parts.values())}


def compare_generation(shape: ModelShape, tp: int, slots: int, rollouts: int, prompt: int,
                       response: int, samples: int) -> dict[str, dict[str, float]]:
    """{kind: {model, rehearsed, ratio}} for one generation rank (`rehearse_generation`)."""
    args = (shape, tp, slots, rollouts, prompt, response, samples)
    r = rehearse_generation(*args)
    measured = {"weights": r.weights, "kv": r.kv, "transient": r.peak - r.weights - r.kv,
                "peak": r.peak}
    return _side_by_side(predicted_generation(*args), measured)


def _side_by_side(model: dict[str, float], measured: dict[str, float]
                  ) -> dict[str, dict[str, float]]:
    return {k: {"model": model[k], "rehearsed": measured[k],
                "ratio": model[k] / measured[k] if measured[k]
                else 1.0 if not model[k] else float("inf")}
            for k in measured}


def parse_layout(text: str) -> Layout:
    """`dp=16,zero=3,activation_checkpointing=true` -> Layout; a bad item or value is a
    ConfigError naming it."""
    fields: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"layout item {item!r} is not key=value; write e.g. "
                              "--layout dp=16,zero=3,tp=2")
        fields[key.strip()] = yaml.safe_load(value.strip())
    try:
        return Layout(**fields)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                             for err in e.errors())
        raise ConfigError(f"--layout {text!r}: {problems}") from None


def render(rows: dict[str, dict[str, float]], title: str) -> str:
    """The comparison as a text table: GiB for bytes, TFLOP for FLOPs."""
    lines = [title, f"{'kind':<10} {'model':>10} {'rehearsed':>10} {'model/rehearsed':>16}"]
    for kind, r in rows.items():
        unit = 1e12 if kind == "flops" else 2**30
        lines.append(f"{kind:<10} {r['model'] / unit:>10.2f} {r['rehearsed'] / unit:>10.2f} "
                     f"{r['ratio']:>16.2f}")
    if "flops" in rows:
        lines.append("(bytes in GiB per rank, FLOPs in TFLOP per rank and micro-batch; sent: "
                     "bytes the rank sends in the step's collectives)")
    else:
        lines.append("(bytes in GiB per rank)")
    return "\n".join(lines)
