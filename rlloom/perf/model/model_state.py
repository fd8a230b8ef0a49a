"""Time the model state itself costs a step, beyond the layers' work: the AdamW update, and the
copies between device and host memory of an offloaded layout (`Layout.offload`)."""
from __future__ import annotations

from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import GIB, Hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.plan import Layout

# AdamW per parameter: reads the fp32 weight, gradient and two moments, writes the weight and
# the moments back (7 x 4 B); the update's few FLOPs per parameter are memory-bound.
ADAMW_B = 28
MASTER_B = 4  # an offloaded trained shard is the fp32 master, copied in before its cast
REDUCED_GRAD_B = 4  # FSDP2 reduces gradients in fp32 (`mixed_precision_policy`)


def offloads(layout: Layout, hw: Hardware) -> bool:
    """The layout keeps its shards in host memory apart from the device's: on a CPU the device
    is the host and offloading moves nothing."""
    return layout.offload and hw.host_link_bw > 0


def resident_bytes(shape: ModelShape, layout: Layout, hw: Hardware, trainable: bool,
                   lora_rank: int = 0) -> tuple[float, float]:
    """(device, host) bytes of a model's state per device: an offloaded layout's ZeRO-3
    shards are in host memory where the host is not the device."""
    moved = offloads(layout, hw)
    device = mem.model_state_bytes(shape, layout, trainable, lora_rank=lora_rank,
                                   offloaded=moved)
    return device, mem.host_state_bytes(shape, layout, trainable, lora_rank) if moved else 0.0


def host_fits(nbytes: float, hw: Hardware) -> bool:
    return nbytes <= hw.host_mem_gib * GIB * mem.USABLE


def _sharded_params(shape: ModelShape, layout: Layout, lora_rank: int) -> float:
    """Parameters this device updates: ZeRO 1-3 shard all but the routed experts over dp."""
    experts = mem.expert_params_per_device(shape, layout)
    p = shape.lora_params(lora_rank) if lora_rank else mem.params_per_device(shape, layout) \
        - experts
    return (p / layout.dp if layout.zero else p) + (0.0 if lora_rank else experts)


def optimizer_s(shape: ModelShape, layout: Layout, hw: Hardware, lora_rank: int = 0) -> float:
    """One AdamW step over this device's shard: on the device, or on the host's CPU (streaming
    host memory) when offloaded."""
    bw = hw.host_mem_bw if offloads(layout, hw) else hw.mem_bw
    return ADAMW_B * _sharded_params(shape, layout, lora_rank) / (bw * hw.mem_eff)


def offload_copy_s(shape: ModelShape, layout: Layout, hw: Hardware, micro_batches: int,
                   trained: bool, lora_rank: int = 0) -> float:
    """Host <-> device copies of an offloaded layout's shards for `micro_batches` micro-batches:
    each gather first copies the layer's shard in (forward and backward when trained, forward
    alone when scoring), and a trained shard's reduced gradient is copied back out (FSDP2
    accumulates micro-batches' gradients in host memory). They run on the gathers' stream, so
    they overlap compute as the gathers do."""
    if not offloads(layout, hw):
        return 0.0
    shard = (mem.params_per_device(shape, layout) - mem.expert_params_per_device(shape, layout)) \
        / layout.dp
    if not trained:
        return micro_batches * mem.PARAM_B * shard / hw.host_link_bw
    grads = shape.lora_params(lora_rank) / layout.dp if lora_rank else shard
    return micro_batches * (2 * MASTER_B * shard + REDUCED_GRAD_B * grads) / hw.host_link_bw
