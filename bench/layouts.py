"""Training step time and memory per rank for each parallel layout, measured on this machine next
to the performance model's prediction for the same plan:
``python bench/layouts.py [--hidden 256] [--layers 4] [--batch 16] [--seq 128] [--steps 5]``.

Every layout trains the same qwen3-style CausalLM (fp32, AdamW, next-token loss) on the same
batch of `--batch` sequences of `--seq` input tokens, in freshly forked gloo processes. Each rank
runs `--threads` intra-op threads (default 1), the single-process baseline included, so a
2-rank layout on a 2-core machine has twice the cores of the baseline; a 4-rank layout
(dp2xtp2) on 2 cores is oversubscribed and its times count waiting for a core.

Step time: one warm-up step, then the median over `--steps` steps of the slowest rank's
forward + backward + optimizer step, in wall time and in the rank's own CPU time (which other
jobs on a shared machine do not inflate). Memory per rank, the largest over ranks:
  tensor state  local parameters + gradients + optimizer state at the end of a step, counted
                from the tensors themselves (DTensors by their local shard);
  RSS high-water  the process's peak resident set (getrusage ru_maxrss) over model build and
                all steps, minus its resident set just before the build. On Linux the peak is
                first reset to the current size (/proc/self/clear_refs), so the imports that
                preceded the build do not hide it. It includes activations, gathered ZeRO-3
                parameters, gloo buffers and allocator slack, which the tensor state does not.

Predictions: `perf.cost.training` (one epoch, one mini-batch, micro-batch = the rank's rows,
dtype fp32) on `hardware("local")` (from `rlloom bench hw`), and `perf.memory`'s model state.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.nn.functional as F

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.parallel.apply import make_optimizer, parallelize
from rlloom.parallel.data_parallel import local_tensor
from rlloom.parallel.mesh import build_mesh
from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import Hardware, hardware, load_hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.plan import Layout

LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {},
    "dp2-zero0": dict(dp=2, zero=0),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero2": dict(dp=2, zero=2),
    "dp2-zero3": dict(dp=2, zero=3),
    "tp2-sp": dict(tp=2),
    "dp2-zero3-ac": dict(dp=2, zero=3, activation_checkpointing=True),
    "dp2xtp2": dict(dp=2, tp=2),
}
MIB = 2**20
SEED = 0

# Ranks fork from a server that imported torch and rlloom once: a fresh process per layout
# without paying the imports each time, and without the parent's OpenMP threads.
multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed.tensor", "rlloom.parallel.apply"])


# ---- inside each rank ---------------------------------------------------------------------

def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(family="qwen3", vocab_size=a.vocab, hidden_size=a.hidden,
                       intermediate_size=a.ffn, num_layers=a.layers, num_heads=a.heads,
                       num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads, qk_norm=True,
                       max_position_embeddings=max(2048, a.seq + 1))


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux, or not allowed: the delta then undercounts by any earlier peak


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def tensor_state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optim": sum(_nbytes(v) for s in optim.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)),
    }


def rank_main(a: argparse.Namespace, layout_kw: dict[str, Any]) -> dict[str, Any]:
    layout = Layout(**layout_kw)
    _reset_peak_rss()
    rss0 = _peak_rss_bytes()
    mesh = build_mesh(layout) if layout.world_size > 1 else None
    model = CausalLM(model_config(a))
    model.init_weights(SEED)  # same weights on every rank, as parallelize requires
    parallelize(model, layout, mesh)
    optim = make_optimizer(model, layout, mesh, lr=a.lr)

    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1),
                        generator=torch.Generator().manual_seed(SEED + 1))
    group = None
    if mesh is not None:
        # TP ranks of one dp rank share its rows.
        ids = ids.chunk(layout.dp)[mesh["dp"].get_local_rank()]
        group = mesh["dp"].get_group()
    inputs, targets = ids[:, :-1], ids[:, 1:]

    times, cpu, losses, state = [], [], [], {}
    for step in range(1 + a.steps):
        if dist.is_initialized():
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        # Every row is a full sequence and dp splits rows evenly, so each rank's token mean,
        # averaged over dp by the gradient reduction, is the global token mean.
        loss = F.cross_entropy(model(inputs).reshape(-1, a.vocab), targets.reshape(-1))
        loss.backward()
        optim.step()
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        if step == a.steps:
            state = tensor_state_bytes(model, optim)  # before zero_grad frees the gradients
        optim.zero_grad()
        if step:
            times.append(elapsed)
            cpu.append(cpu_s)
        total = loss.detach() / layout.dp
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
    return {"times": times, "cpu": cpu, "losses": losses, "state": state,
            "rss_peak": _peak_rss_bytes() - rss0,
            "n_params": sum(local_tensor(p).numel() for p in model.parameters())}


def _entry(rank: int, world: int, threads: int, out_dir: str,
           a: argparse.Namespace, layout_kw: dict[str, Any]) -> None:
    torch.set_num_threads(threads)
    # a rendezvous file: a port picked free beforehand can be taken before rank 0 listens
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = rank_main(a, layout_kw)
        with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def measure(a: argparse.Namespace, layout_kw: dict[str, Any]) -> list[dict[str, Any]]:
    world = Layout(**layout_kw).world_size
    with tempfile.TemporaryDirectory() as out_dir:
        tmp.start_processes(_entry, args=(world, a.threads, out_dir, a, layout_kw),
                            nprocs=world, start_method="forkserver")
        results = []
        for r in range(world):
            with open(Path(out_dir) / f"{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


# ---- the performance model's view of the same plan ----------------------------------------

def model_shape(a: argparse.Namespace) -> ModelShape:
    return ModelShape("bench", layers=a.layers, hidden=a.hidden, ffn=a.ffn, heads=a.heads,
                      kv_heads=a.kv_heads, head_dim=a.hidden // a.heads, vocab=a.vocab)


def rank_hardware(hw: Hardware, ranks: int, threads: int) -> Hardware:
    """`hw` as one rank sees it. `rlloom bench hw` measured the whole machine with
    `extra["threads"]` threads; a rank gets min(threads, cpus / ranks) cores of it, so its
    compute and memory rates scale by that share, and its operator dispatch (one thread)
    slows down when it gets less than a whole core."""
    cpus = hw.extra.get("cpus", os.cpu_count() or 1)
    measured = hw.extra.get("threads", cpus)
    cores = min(threads, cpus / ranks)
    share = cores / measured
    return replace(hw, peak_flops={k: v * share for k, v in hw.peak_flops.items()},
                   mem_bw=hw.mem_bw * share, launch_s=hw.launch_s / min(1.0, cores))


def predict(a: argparse.Namespace, layout: Layout, hw: Hardware) -> dict[str, float]:
    shape = model_shape(a)
    wl = Workload(prompts=a.batch, samples=1, prompt_len=0, response=Lengths("fixed", p50=a.seq),
                  ppo_epochs=1, minibatches=1, micro_batch=a.batch // layout.dp, dtype="fp32")
    stage = cost.training(shape, layout, wl, rank_hardware(hw, layout.world_size, a.threads),
                          "actor")
    return {"step_s": stage.seconds, "transient": stage.transient_bytes,
            "state_fp32": mem.model_state_bytes(shape, layout, trainable=True)}


# ---- driver -------------------------------------------------------------------------------

def run_layout(a: argparse.Namespace, name: str, hw: Hardware) -> dict[str, Any]:
    layout_kw = LAYOUTS[name]
    layout = Layout(**layout_kw)
    t0 = time.perf_counter()
    ranks = measure(a, layout_kw)
    per_step = [max(r["times"][i] for r in ranks) for i in range(a.steps)]
    cpu_step = [max(r["cpu"][i] for r in ranks) for i in range(a.steps)]
    state = [sum(r["state"].values()) for r in ranks]
    row = {"layout": name, "ranks": layout.world_size,
           "step_s": statistics.median(per_step), "step_s_all": per_step,
           "cpu_s": statistics.median(cpu_step),
           "state": max(state), "state_ranks": state,
           "state_parts": ranks[state.index(max(state))]["state"],
           "rss": max(r["rss_peak"] for r in ranks),
           "loss_first": ranks[0]["losses"][0], "loss_last": ranks[0]["losses"][-1],
           "params_global": ranks[0]["n_params"] if layout.world_size == 1 else None,
           "wall_s": time.perf_counter() - t0}
    row["predicted"] = predict(a, layout, hw)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'layout':<13} {'ranks':>5} {'meas step s':>11} {'pred step s':>11} "
            f"{'pred/meas':>9} {'meas CPU s':>10} {'meas state':>10} {'pred state':>10} "
            f"{'RSS high-water':>14} {'pred transient':>14} "
            f"{'loss 1st':>8} {'loss last':>9}")
    unit = (f"{'':<13} {'':>5} {'':>11} {'':>11} {'':>9} {'per rank':>10} {'MiB/rank':>10} "
            f"{'fp32 MiB':>10} {'MiB/rank':>14} {'MiB/rank':>14}")
    lines = [head, unit, "-" * len(head)]
    for r in rows:
        p = r["predicted"]
        lines.append(
            f"{r['layout']:<13} {r['ranks']:>5} {r['step_s']:>11.3f} {p['step_s']:>11.3f} "
            f"{p['step_s'] / r['step_s']:>9.2f} {r['cpu_s']:>10.3f} {r['state'] / MIB:>10.1f} "
            f"{p['state_fp32'] / MIB:>10.1f} "
            f"{r['rss'] / MIB:>14.1f} {p['transient'] / MIB:>14.1f} "
            f"{r['loss_first']:>8.4f} {r['loss_last']:>9.4f}")
    return "\n".join(lines)


def relative(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["layout"] == "single"), None)
    if base is None:
        return ""
    bp = base["predicted"]
    lines = ["relative to single process (x single):",
             f"{'layout':<13} {'meas step':>9} {'pred step':>9} {'meas CPU':>9} "
             f"{'meas state':>10} {'pred state':>10} {'RSS':>6}"]
    for r in rows:
        lines.append(f"{r['layout']:<13} {r['step_s'] / base['step_s']:>9.2f} "
                     f"{r['predicted']['step_s'] / bp['step_s']:>9.2f} "
                     f"{r['cpu_s'] / base['cpu_s']:>9.2f} {r['state'] / base['state']:>10.2f} "
                     f"{r['predicted']['state_fp32'] / bp['state_fp32']:>10.2f} "
                     f"{r['rss'] / base['rss']:>6.2f}")
    return "\n".join(lines)


NOTES = """\
meas step s: median over steps of the slowest rank's wall time; meas CPU s: the same for the
  rank's own CPU time (all its threads), which other load on the machine does not inflate.
pred step s: cost.training priced with each rank's share of the measured cores.
meas state: local params + grads + AdamW state, counted from the tensors at the end of a step.
pred state fp32: memory.model_state_bytes' ZeRO formulas: fp32 params and grads (4 + 4 B) and
  moments (8 B), as the runtime trains with any compute dtype. It counts parameters at their
  resting size: ZeRO-2 holds the full parameters only between its forward and backward (FSDP2
  reshards them after backward), and TP here leaves embeddings, lm_head and norms replicated,
  which the model splits by tp.
RSS high-water: peak resident set minus the resident set before the model was built
  (activations, gathered parameters, gloo buffers, allocator slack included).
pred transient: cost.training's activations and working weight copies beyond the gradients,
  priced with bf16 compute; this fp32 run keeps fp32 activations."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768, help="intermediate size")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (all ranks)")
    p.add_argument("--seq", type=int, default=128, help="input tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="timed steps after 1 warm-up")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--hardware", default="local",
                   help="'local' (`rlloom bench hw`), a catalogue name, or a Hardware JSON path")
    p.add_argument("--json", type=Path, help="also write the rows here")
    a = p.parse_args(argv)
    if a.batch % 2:
        p.error("--batch must be even: dp=2 layouts split it in two")
    return a


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    a = parse(argv)
    hw = (load_hardware(a.hardware) if a.hardware.endswith(".json") else hardware(a.hardware))
    shape = model_shape(a)
    cpus = os.cpu_count() or 1
    print(f"model: qwen3 hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} "
          f"kv, ffn {a.ffn}, vocab {a.vocab}: {shape.params / 1e6:.2f} M params (perf shape); "
          f"batch {a.batch} x {a.seq} tokens, fp32 AdamW; median of {a.steps} steps after 1 "
          f"warm-up; {a.threads} thread(s) per rank on {cpus} CPUs", flush=True)
    print(f"hardware {hw.name}: fp32 {hw.peak_flops['fp32'] / 1e9:.0f} GFLOP/s with "
          f"{hw.extra.get('threads', '?')} threads, memory {hw.mem_bw / 1e9:.1f} GB/s, "
          f"dispatch {hw.launch_s * 1e6:.1f} us; each rank is priced with its share of the cores "
          "(min(threads, cpus/ranks) / measured threads)", flush=True)
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5:
        print(f"load average {os.getloadavg()[0]:.1f} before start: other processes share the "
              "CPUs, so wall times are inflated; compare the CPU-time column", flush=True)
    rows = []
    for name in a.layouts:
        ranks = Layout(**LAYOUTS[name]).world_size
        note = " (oversubscribed: more rank threads than CPUs)" if ranks * a.threads > cpus \
            else ""
        print(f"  {name}: {ranks} rank(s){note} ...", end="", flush=True)
        row = run_layout(a, name, hw)
        print(f" {row['wall_s']:.1f} s", flush=True)
        rows.append(row)
    params = next((r["params_global"] for r in rows if r["params_global"]), None)
    if params:
        print(f"parameters counted in the model: {params / 1e6:.3f} M "
              f"(the perf shape leaves out the per-head q/k norms)")
    print()
    print(table(rows))
    print()
    print(relative(rows))
    print()
    print(NOTES)
    if any(r["ranks"] * a.threads > cpus for r in rows):
        print(f"layouts with more rank threads than the {cpus} CPUs share cores: their measured"
              " times include waiting for a core.")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
