"""What data parallelism costs a dispatch-bound model on this machine, side by side in one
run: `python bench/dp_overhead.py`. The built-in model's shape of bench/schedules.py (hidden
64, 2 layers), one thread per rank, a forward and backward of 16 rows x 30 tokens per rank:
- one plain process (and 32 rows, the whole batch of the two ranks);
- two plain ranks with no wrapper (the cores' contention alone);
- two ranks under `replicate` (ZeRO-0), with and without the gradient all-reduce.
The gaps are what `bench/schedules.py`'s colocated dp2 arm pays beyond the priced work."""
from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.parallel.apply import parallelize
from rlloom.parallel.mesh import build_mesh
from rlloom.plan import Layout

CFG = ModelConfig(family="qwen3", vocab_size=60, hidden_size=64, intermediate_size=192,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, qk_norm=True)
REPEATS = 20


def fwd_bwd_ms(model: torch.nn.Module, rows: int) -> float:
    ids = torch.randint(3, 60, (rows, 30), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()   # warm-up
    t = time.perf_counter()
    for _ in range(REPEATS):
        model(ids).float().logsumexp(-1).mean().backward()
    return (time.perf_counter() - t) / REPEATS * 1000


def model() -> CausalLM:
    m = CausalLM(CFG)
    m.init_weights(seed=0)
    return m


def rank(r: int, rendezvous: str, wrapped: bool, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=r, world_size=2)
    m = model()
    if wrapped:
        layout = Layout(dp=2)
        parallelize(m, layout, build_mesh(layout, "cpu"), mixed_precision=False)
        out["replicate, gradients all-reduced"] = fwd_bwd_ms(m, 16)
        m.set_requires_gradient_sync(False)
        out["replicate, no gradient sync"] = fwd_bwd_ms(m, 16)
    else:
        out["two plain ranks"] = fwd_bwd_ms(m, 16)
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    times = {"one process, 16 rows": fwd_bwd_ms(model(), 16),
             "one process, 32 rows": fwd_bwd_ms(model(), 32)}
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        for wrapped in (False, True):
            out = manager.dict()
            # a rendezvous file: a port picked free beforehand can be taken meanwhile
            mp.spawn(_rank, args=(f"file://{tmp}/{wrapped}", wrapped, out), nprocs=2)
            times.update(out)
    base = times["one process, 16 rows"]
    print(f"{'forward + backward of 16 rows per rank':<40}{'ms':>8}{'x one process':>15}")
    for name, ms in times.items():
        print(f"{name:<40}{ms:>8.2f}{ms / base:>15.2f}")


def _rank(r: int, rendezvous: str, wrapped: bool, out: dict) -> None:
    mine: dict = {}
    rank(r, rendezvous, wrapped, mine)
    if r == 0:
        out.update(mine)


if __name__ == "__main__":
    main()
