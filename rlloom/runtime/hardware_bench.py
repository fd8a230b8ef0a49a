"""`rlloom bench hw`: measure this machine and save it as a Hardware file for the performance
model. Measured rates are what kernels achieve here, so the efficiencies are 1."""
from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from rlloom.perf.model.hardware import GIB, Hardware, local_hardware_path


def _best_seconds(fn: Callable[[], object], min_time: float = 0.3, repeats: int = 3) -> float:
    """Fastest mean time per call over `repeats` timed batches of at least `min_time` each:
    the minimum filters out the noise of a shared machine."""
    fn()
    calls, t = 1, 0.0
    while True:  # grow the batch until it runs long enough to time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = time.perf_counter() - t0
        if t >= min_time:
            break
        calls *= 2
    best = t / calls
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b)


def memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes read plus written per second by a large copy."""
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src))


def attention_element_seconds(rows: int = 32, heads: int = 4, head_dim: int = 32) -> float:
    """Seconds per causal score element and head of a fused attention forward (SDPA, as the
    runtime's teacher-forced passes call it), from the difference between two context
    lengths so that the call's fixed cost cancels."""
    def seconds(t: int) -> float:
        q, k, v = (torch.randn(rows, heads, t, head_dim) for _ in range(3))
        with torch.no_grad():
            return _best_seconds(lambda: F.scaled_dot_product_attention(q, k, v,
                                                                        is_causal=True))
    short, long = 64, 128
    elements = rows * heads * (long * (long + 1) - short * (short + 1)) / 2
    return max(seconds(long) - seconds(short), 0.0) / elements


def _dispatch_model() -> tuple[torch.nn.Module, torch.Tensor, int]:
    """A model too small to compute anything, its input, and the operators a forward
    dispatches (the same code path a tiny model's decode takes)."""
    from rlloom.models.config import ModelConfig
    from rlloom.models.transformer import CausalLM

    model = CausalLM(ModelConfig("qwen3", 16, 8, 16, 1, 1, 1, 8, qk_norm=True))
    ids = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        return model, ids, _operators(lambda: model(ids))


def _operators(fn: Callable[[], object]) -> int:
    """How many operators `fn()` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            Count.ops += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.ops


def dispatch_seconds() -> float:
    """Host time per operator: a forward of `_dispatch_model` divided by its operators."""
    model, ids, ops = _dispatch_model()
    with torch.no_grad():
        return _best_seconds(lambda: model(ids)) / ops


# A run of a model too small to compute, at the batch of a small experiment: its stages'
# time is the runtime's host work
STAGE_RUN = ["model.hidden_size=16", "model.layers=2", "model.heads=2", "model.kv_heads=1",
             "train.prompts_per_step=16", "rollout.n_samples=4", "sft.steps=300",
             "checkpoint.every=1000", "eval.every=1000"]


def stage_dispatch_seconds(hw: Hardware, steps: int = 5) -> tuple[float, float]:
    """Host seconds per operator of the runtime's assessment and training stages: `steps`
    steps (after a warm-up one) of `STAGE_RUN`, less their device work priced at `hw`'s
    rates, over the operators the cost model prices for them. What a plain forward's
    dispatch (`launch_s`) leaves out: the stage code's Python between operators, the
    objective's and the scoring's small operators over tokens."""
    import tempfile

    from rlloom.config import load_config
    from rlloom.perf.model.compose import role_models
    from rlloom.perf.model.shapes import model_shape
    from rlloom.perf.validation.validate import LoadedRun, measured_step, price_run, run_roles
    from rlloom.runtime.executor.launch import local_loop

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*STAGE_RUN, f"run_dir={tmp}"])
        loop = local_loop(cfg, Path(tmp))
        loop.ex.start()
        try:
            loop.train_step()  # warm-up
            rows = [loop.train_step() for _ in range(steps)]
        finally:
            loop.ex.stop()
        models = role_models(model_shape(str(loop.model_path)), run_roles(cfg))
    run = LoadedRun("stages", models, cfg.plan, [measured_step(row, cfg) for row in rows])
    plain = replace(hw, assess_launch_s=0.0, train_launch_s=0.0)
    ops = price_run(run, replace(plain, launch_s=1.0, attn_elem_s=0.0, mem_bw=math.inf,
                                 peak_flops={k: math.inf for k in hw.peak_flops}))
    device = price_run(run, replace(plain, launch_s=0.0))

    def per_op(stage: str) -> float:
        def total(points: list, of: str) -> float:
            return sum(getattr(p, of) for p in points if p.stage == stage)
        return max(total(device, "measured_s") - total(device, "predicted_s"), 0.0) / \
            total(ops, "predicted_s")
    return per_op("assessment"), per_op("training")


def _wrapper_worker(rank: int, port: int, out: dict) -> None:
    """In a world of one gloo process, `_dispatch_model` trained plain and under FSDP2's
    replicate (each layer and the root wrapped, as every data-parallel layout that trains):
    the added time of a forward + backward per wrapped module, and of an optimizer step
    (clipping, AdamW, zero_grad) per operator."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from rlloom.parallel.grads import clip_grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        timed = []
        for wrapped in (False, True):
            model, ids, _ = _dispatch_model()
            layers = list(model.model.layers)
            if wrapped:
                mesh = init_device_mesh("cpu", (1,))
                for module in [*layers, model]:
                    replicate(module, mesh=mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def pass_(model: torch.nn.Module = model) -> None:
                model(ids).float().sum().backward()

            def step(model: torch.nn.Module = model, optim: torch.optim.Optimizer = optim
                     ) -> None:
                clip_grad_norm(model.parameters(), 1.0)
                optim.step()
                optim.zero_grad(set_to_none=False)
            pass_()
            step()
            timed.append((_best_seconds(pass_), _best_seconds(step)))
        ops = _operators(step)  # the wrapped model's: the same operators as the plain one
        out["wrapped_pass_s"] = max(timed[1][0] - timed[0][0], 0.0) / (len(layers) + 1)
        out["sharded_launch_s"] = max(timed[1][1] - timed[0][1], 0.0) / ops
    finally:
        dist.destroy_process_group()


def wrapper_seconds() -> tuple[float, float]:
    """(seconds per wrapped module per forward + backward, added seconds per optimizer-step
    operator) of FSDP2's data-parallel wrappers (see `_wrapper_worker`)."""
    out = _spawned(_wrapper_worker, 1)
    return out["wrapped_pass_s"], out["sharded_launch_s"]


def _reduce_worker(rank: int, port: int, out: dict) -> None:
    """Two gloo processes training `_dispatch_model` under replicate, both at once: the
    added time of a backward that all-reduces the gradients over one that does not, per
    wrapped module."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, ids, _ = _dispatch_model()
        modules = [*model.model.layers, model]
        mesh = init_device_mesh("cpu", (2,))
        for module in modules:
            replicate(module, mesh=mesh)

        def pass_() -> None:
            model(ids).float().sum().backward()
        timed = []
        for sync in (True, False):
            model.set_requires_gradient_sync(sync)
            pass_()
            dist.barrier()
            timed.append(_best_seconds(pass_, min_time=0.2))
        if rank == 0:
            out["reduce_s"] = max(timed[0] - timed[1], 0.0) / len(modules)
    finally:
        dist.destroy_process_group()


def reduce_seconds() -> float:
    """Seconds of one wrapped module's gradient all-reduce under replicate, two ranks busy
    (see `_reduce_worker`)."""
    return _spawned(_reduce_worker, 2)["reduce_s"]


def _all_reduce_worker(rank: int, port: int, sizes: list[int], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for n in sizes:
            x = torch.ones(n // 4)
            seconds = _best_seconds(lambda: dist.all_reduce(x), min_time=0.2)
            if rank == 0:
                out[n] = seconds
    finally:
        dist.destroy_process_group()


def all_reduce_times(sizes: list[int]) -> dict[int, float]:
    """Seconds per gloo all-reduce between two local processes, by message bytes."""
    return _spawned(_all_reduce_worker, 2, sizes)


def _spawned(worker: Callable[..., None], nprocs: int, *args: Any) -> dict:
    """What `worker(rank, port, *args, out)` put in `out`, run in `nprocs` processes that
    meet at a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(port, *args, out), nprocs=nprocs)
        return dict(out)


def measure(progress: Callable[[str], None] = print) -> Hardware:
    progress("matmul fp32 ...")
    fp32 = matmul_flops(torch.float32)
    progress("matmul bf16 ...")
    bf16 = matmul_flops(torch.bfloat16)
    progress("memory bandwidth ...")
    bw = memory_bandwidth()
    progress("attention ...")
    attn_elem = attention_element_seconds()
    progress("operator dispatch ...")
    launch = dispatch_seconds()
    progress("data-parallel wrappers ...")
    wrapped, sharded = wrapper_seconds()
    progress("gloo all-reduce between 2 processes ...")
    small, large = 4, 16 * 2**20
    times = all_reduce_times([small, large])
    progress("gradient all-reduce from replicate's hooks, 2 ranks busy ...")
    reduce = reduce_seconds()
    # A 2-process ring all-reduce sends n/2 bytes twice: alpha from the tiny message, the
    # bandwidth from the large one net of that latency.
    alpha = times[small] / 2
    link = large / max(times[large] - times[small], 1e-9)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    hw = Hardware("local", {"fp32": fp32, "bf16": bf16}, mem_gib=round(ram, 1), mem_bw=bw,
                  intra_node_bw=link, inter_node_bw=link, devices_per_node=1,
                  intra_node_latency=alpha, inter_node_latency=alpha, compute_eff=1.0,
                  mem_eff=1.0, comm_eff=1.0, attn_elem_s=attn_elem, launch_s=launch,
                  sharded_launch_s=sharded,
                  wrapped_pass_s=wrapped, reduce_s=reduce,
                  # the device is the host: offloaded state stays in the same memory
                  host_mem_gib=round(ram, 1), host_mem_bw=bw,
                  extra={"threads": float(torch.get_num_threads()),
                         "cpus": float(os.cpu_count() or 1)})
    progress("the runtime's stages on a model too small to compute ...")
    assess_launch, train_launch = stage_dispatch_seconds(hw)
    return replace(hw, assess_launch_s=assess_launch, train_launch_s=train_launch)


def bench_hw(out: Path | None = None) -> str:
    hw = measure()
    path = out or local_hardware_path()
    hw.save(path)
    return (f"fp32 matmul {hw.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, bf16 "
            f"{hw.peak_flops['bf16'] / 1e9:.1f} GFLOP/s, memory {hw.mem_bw / 1e9:.1f} GB/s, "
            f"attention {hw.attn_elem_s * 1e9:.1f} ns per score element, "
            f"operator dispatch {hw.launch_s * 1e6:.1f} us (assessment "
            f"{hw.assess_launch_s * 1e6:.1f}, training {hw.train_launch_s * 1e6:.1f} us per "
            "operator in the runtime's stages), FSDP2 wrappers "
            f"{hw.wrapped_pass_s * 1e6:.0f} us per module per forward + backward and "
            f"+{hw.sharded_launch_s * 1e6:.1f} us per optimizer operator, "
            f"{hw.reduce_s * 1e6:.0f} us per module's gradient all-reduce, gloo all-reduce "
            "latency "
            f"{hw.intra_node_latency * 1e6:.0f} us and {hw.intra_node_bw / 1e9:.2f} GB/s\n"
            f"saved {path} (use it as --gpus NxLOCAL or `rlloom perf validate`); its "
            "efficiencies are 1.0, the microbenchmarks' rates: `rlloom perf calibrate RUN_DIR` "
            "fits them to measured runs")
