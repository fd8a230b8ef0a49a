"""`rlloom bench hw`: measure this machine and save it as a Hardware file for the performance
model. Measured rates are what kernels achieve here, so the efficiencies are 1."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from rlloom.perf.model.hardware import (
    GIB,
    Hardware,
    installed_version,
    local_hardware_path,
    measurement_doubts,
)


@dataclass(frozen=True)
class Budget:
    """How long the microbenchmarks time: each batch of calls runs `min_time` seconds at least
    (`collective_min_time` for the 2-process ones), repeats stop once `budget_s` has passed,
    and the runtime's stages run `stage_steps` steps."""
    min_time: float = 0.3
    collective_min_time: float = 0.2
    budget_s: float = 1.5
    stage_steps: int = 5


FULL = Budget()
# `rlloom bench hw --quick`: a tenth of the timing, for a file to try the cost model with
# (about 20 s instead of 45 on 2 cores); its prices are rougher and the file says so
QUICK = Budget(min_time=0.03, collective_min_time=0.02, budget_s=0.15, stage_steps=2)


def _best_seconds(fn: Callable[[], object], min_time: float, budget_s: float,
                  agree: Callable[[bool], bool] = lambda more: more) -> tuple[float, float]:
    """Fastest mean time per call over timed batches of at least `min_time` each, and the
    batches' spread ((median - fastest) / fastest): batches repeat, 3 at least, until the
    spread is under 5% or `budget_s` has passed. The minimum filters out a shared machine's
    noise; a spread that stays wide says the noise won (`measurement_doubts`). Ranks timing a
    collective must call it as often as each other: `agree(more)` turns this rank's wish for
    another batch into the ranks' common answer (`_any_rank`)."""
    fn()
    calls, t = 1, 0.0
    while True:  # grow the batch until it runs long enough to time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = time.perf_counter() - t0
        if not agree(t < min_time):
            break
        calls *= 2
    times, start = [t / calls], time.perf_counter()
    while True:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
        best = min(times)
        spread = (statistics.median(times) - best) / best
        done = len(times) >= 3 and (spread < 0.05 or time.perf_counter() - start > budget_s)
        if not agree(not done):
            return best, spread


def _timed(fn: Callable[[], object], budget: Budget) -> tuple[float, float]:
    """`_best_seconds` of a one-process microbenchmark at `budget`."""
    return _best_seconds(fn, budget.min_time, budget.budget_s)


def _any_rank(more: bool) -> bool:
    """True on every rank when any rank wants another batch (a one-element all-reduce)."""
    flag = torch.tensor([int(more)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def matmul_flops(dtype: torch.dtype, budget: Budget, n: int = 1024) -> tuple[float, float]:
    """FLOP/s of an n x n matmul, and its spread."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best, spread = _timed(lambda: a @ b, budget)
    return 2 * n**3 / best, spread


def memory_bandwidth(budget: Budget, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """Bytes read plus written per second by a large copy, and its spread."""
    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    best, spread = _timed(lambda: dst.copy_(src), budget)
    return 2 * nbytes / best, spread


def attention_element_seconds(budget: Budget, rows: int = 32, heads: int = 4,
                              head_dim: int = 32) -> tuple[float, float]:
    """Seconds per causal score element and head of a fused attention forward (SDPA, as the
    runtime's teacher-forced passes call it), from the difference between two context
    lengths so that the call's fixed cost cancels; and the wider spread of the two."""
    def seconds(t: int) -> tuple[float, float]:
        q, k, v = (torch.randn(rows, heads, t, head_dim) for _ in range(3))
        with torch.no_grad():
            return _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                          budget)
    short, long = 64, 128
    elements = rows * heads * (long * (long + 1) - short * (short + 1)) / 2
    (t_long, s_long), (t_short, s_short) = seconds(long), seconds(short)
    return max(t_long - t_short, 0.0) / elements, max(s_long, s_short)


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


def dispatch_seconds(budget: Budget) -> tuple[float, float]:
    """Host time per operator: a forward of `_dispatch_model` divided by its operators; and
    its spread."""
    model, ids, ops = _dispatch_model()
    with torch.no_grad():
        best, spread = _timed(lambda: model(ids), budget)
    return best / ops, spread


# A run of a model too small to compute, at the batch of a small experiment: its stages'
# time is the runtime's host work
STAGE_RUN = ["model.hidden_size=16", "model.layers=2", "model.heads=2", "model.kv_heads=1",
             "train.prompts_per_step=16", "rollout.n_samples=4", "sft.steps=300",
             "checkpoint.every=1000", "eval.every=1000"]


def stage_dispatch_seconds(hw: Hardware, steps: int) -> tuple[float, float]:
    """Host seconds per operator of the runtime's assessment and training stages: `steps`
    steps (after a warm-up one) of `STAGE_RUN`, less their device work priced at `hw`'s
    rates, over the operators the cost model prices for them. What a plain forward's
    dispatch (`launch_s`) leaves out: the stage code's Python between operators, the
    objective's and the scoring's small operators over tokens."""

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
    run = LoadedRun("stages", models, cfg.plan, [measured_step(row, cfg) for row in rows],
                    cfg.algo.name)
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


@contextmanager
def _world(rank: int, world: int, rendezvous: str) -> Iterator[None]:
    """A one-thread gloo world for a benchmark process, which ends with it. About one `bench
    hw` in five, a rank aborted at the end (a gloo thread's std::terminate, SIGABRT): its
    ranks now meet once more, so that none tears the group down under the other's last
    collective, and a rank that succeeded leaves at once (`os._exit`, its results already in
    the manager's dict) instead of through interpreter teardown, which frees the wrapped
    model's process-group references in whatever order."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def _wrapper_worker(rank: int, rendezvous: str, budget: Budget, out: dict) -> None:
    """In a world of one gloo process, `_dispatch_model` trained plain and under FSDP2's
    replicate (each layer and the root wrapped, as every data-parallel layout that trains):
    the added time of a forward + backward per wrapped module, and of an optimizer step
    (clipping, AdamW, zero_grad) per operator."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    from rlloom.parallel.grads import clip_grad_norm

    with _world(0, 1, rendezvous):
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
            timed.append((_timed(pass_, budget), _timed(step, budget)))
        ops = _operators(step)  # the wrapped model's: the same operators as the plain one
        out["wrapped_pass_s"] = max(timed[1][0][0] - timed[0][0][0], 0.0) / (len(layers) + 1)
        out["sharded_launch_s"] = max(timed[1][1][0] - timed[0][1][0], 0.0) / ops
        out["spread"] = max(spread for pair in timed for _, spread in pair)


def wrapper_seconds(budget: Budget) -> tuple[float, float, float]:
    """(seconds per wrapped module per forward + backward, added seconds per optimizer-step
    operator) of FSDP2's data-parallel wrappers (see `_wrapper_worker`), and the spread."""
    out = _spawned(_wrapper_worker, 1, budget)
    return out["wrapped_pass_s"], out["sharded_launch_s"], out["spread"]


def _pair_worker(rank: int, rendezvous: str, sizes: list[int], budget: Budget, out: dict
                 ) -> None:
    """Two gloo processes (one world for both measurements: each process's start costs
    seconds of imports): a plain all-reduce's seconds per message size in `sizes`; then,
    training `_dispatch_model` under replicate both at once, the added time of a backward that
    all-reduces the gradients over one that does not, per wrapped module."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    def collective(fn: Callable[[], object]) -> tuple[float, float]:
        return _best_seconds(fn, budget.collective_min_time, budget.budget_s, agree=_any_rank)

    with _world(rank, 2, rendezvous):
        for n in sizes:
            x = torch.ones(n // 4)
            seconds = collective(lambda: dist.all_reduce(x))
            if rank == 0:
                out[n] = seconds
        model, ids, _ = _dispatch_model()
        modules = [*model.model.layers, model]
        mesh = init_device_mesh("cpu", (2,))
        for module in modules:
            replicate(module, mesh=mesh)

        def pass_() -> None:
            model(ids).float().sum().backward()
        passes = []
        for sync in (True, False):
            model.set_requires_gradient_sync(sync)
            pass_()
            dist.barrier()
            passes.append(collective(pass_))
        if rank == 0:
            out["reduce_s"] = max(passes[0][0] - passes[1][0], 0.0) / len(modules)
            out["reduce_spread"] = max(spread for _, spread in passes)


def collective_seconds(sizes: list[int], budget: Budget
                       ) -> tuple[dict[int, tuple[float, float]], float, float]:
    """(seconds, spread) per gloo all-reduce between two local processes, by message bytes;
    the seconds of one wrapped module's gradient all-reduce under replicate with two ranks
    busy, and its spread (see `_pair_worker`)."""
    out = _spawned(_pair_worker, 2, sizes, budget)
    return {n: out[n] for n in sizes}, out["reduce_s"], out["reduce_spread"]


def _spawned(worker: Callable[..., None], nprocs: int, *args: Any) -> dict:
    """What `worker(rank, rendezvous, *args, out)` put in `out`, run in `nprocs` processes
    that meet at a rendezvous file: a free port picked here could be taken by another job
    before they bind it, and a rank that met a stranger's store aborts."""
    with tempfile.TemporaryDirectory(prefix="rlloom-bench-") as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(f"file://{tmp}/rendezvous", *args, out), nprocs=nprocs)
        return dict(out)


class OthersLoad:
    """The share of the machine's CPU time that other processes used while the block ran:
    on Linux, /proc/stat's busy time less this process's own and its finished children's;
    elsewhere the 1-minute load average less this process's one busy CPU."""

    def __enter__(self) -> OthersLoad:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        """(machine busy, machine total, own CPU) in seconds."""
        own = os.times()
        mine = own.user + own.system + own.children_user + own.children_system
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except OSError:
            return math.nan, math.nan, mine
        tick = os.sysconf("SC_CLK_TCK")
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields[:8]) - idle) / tick, sum(fields[:8]) / tick, mine

    @property
    def share(self) -> float:
        (busy0, total0, own0), (busy1, total1, own1) = self.start, self.end
        if math.isnan(total0) or total1 <= total0:
            cpus = os.cpu_count() or 1
            return min(max(os.getloadavg()[0] - 1, 0.0) / cpus, 1.0)
        return min(max((busy1 - busy0 - (own1 - own0)) / (total1 - total0), 0.0), 1.0)


def measure(progress: Callable[[str], None] = print, budget: Budget = FULL) -> Hardware:
    """This machine's rates, each microbenchmark's spread and the load of other processes
    while it measured (`measurement_doubts` reads them, and `quick`: 1 when timed at `QUICK`)."""
    with OthersLoad() as load:
        hw, spreads = _measure(progress, budget)
    # a 2-process round trip's latency on a host with no spare core is scheduling jitter
    # (23-52% measured on a quiet 2-core host): kept, but it says nothing of a disturbance
    judged = [v for k, v in spreads.items() if k != "gloo_latency"]
    return replace(hw, rlloom_version=installed_version(),
                   extra={**hw.extra, "measured_at": round(time.time()),
                          **{f"spread_{k}": round(v, 4) for k, v in spreads.items()},
                          "spread_max": round(max(judged), 4),
                          "other_load": round(load.share, 4),
                          "quick": float(budget == QUICK)})


def _measure(progress: Callable[[str], None], budget: Budget
             ) -> tuple[Hardware, dict[str, float]]:
    progress("matmul fp32 ...")
    fp32, s_fp32 = matmul_flops(torch.float32, budget)
    progress("matmul bf16 ...")
    bf16, s_bf16 = matmul_flops(torch.bfloat16, budget)
    progress("memory bandwidth ...")
    bw, s_bw = memory_bandwidth(budget)
    progress("attention ...")
    attn_elem, s_attn = attention_element_seconds(budget)
    progress("operator dispatch ...")
    launch, s_launch = dispatch_seconds(budget)
    progress("data-parallel wrappers ...")
    wrapped, sharded, s_wrapped = wrapper_seconds(budget)
    progress("gloo all-reduce between 2 processes, then replicate's gradient all-reduce ...")
    small, large = 4, 16 * 2**20
    times, reduce, s_reduce = collective_seconds([small, large], budget)
    # A 2-process ring all-reduce sends n/2 bytes twice: alpha from the tiny message, the
    # bandwidth from the large one net of that latency.
    alpha = times[small][0] / 2
    link = large / max(times[large][0] - times[small][0], 1e-9)
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
    assess_launch, train_launch = stage_dispatch_seconds(hw, budget.stage_steps)
    spreads = {"fp32": s_fp32, "bf16": s_bf16, "memory": s_bw, "attention": s_attn,
               "dispatch": s_launch, "wrappers": s_wrapped, "grad_reduce": s_reduce,
               "gloo_latency": times[small][1], "gloo_bandwidth": times[large][1]}
    return replace(hw, assess_launch_s=assess_launch, train_launch_s=train_launch), spreads


def bench_hw(out: Path | None = None, quick: bool = False) -> str:
    hw = measure(budget=QUICK if quick else FULL)
    path = out or local_hardware_path()
    hw.save(path)
    doubts = measurement_doubts(hw)
    quality = (f"repeats within {hw.extra['spread_max']:.0%} of each other, other processes "
               f"used {hw.extra['other_load']:.0%} of the CPUs meanwhile")
    if doubts:
        quality += ("; WARNING, this measurement is doubtful: " + "; ".join(doubts) + ". Stop "
                    "what else runs and measure again (`rlloom bench hw`)")
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
            f"fits them to measured runs\n{quality}")
