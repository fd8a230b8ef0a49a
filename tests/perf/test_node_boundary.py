"""Nodes in the cost model: `--gpus NODESxPERxNAME` sets the devices per node, a collective
whose group crosses a node boundary is priced on the NIC instead of NVLink, and the planner
keeps tensor- and context-parallel groups inside a node."""
import math
from dataclasses import replace

import pytest

from rlloom.perf.model import cost
from rlloom.perf.model import memory as mem
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import MODELS
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import search
from rlloom.perf.search.report import parse_gpus
from rlloom.plan import Layout

Q7 = MODELS["qwen2.5-7b"]


def test_gpus_names_nodes_and_devices_per_node():
    assert parse_gpus("2x8xH100") == (16, "h100", 8)
    assert parse_gpus("64xH100") == (64, "h100", None)
    for bad in ("two nodes", "0x8xH100", "2x0xH100", "8x"):
        with pytest.raises(ValueError, match="nodes x devices per node"):
            parse_gpus(bad)


def test_a_node_boundary_costs_the_gradient_all_reduce_over_the_nic():
    """dp16 at ZeRO-0 on one 16-device node against two nodes of 8: the training stage's
    communication differs by exactly the ring all-reduce of the fp32 gradients, 2 (p - 1)
    steps of (latency + bytes / p / bandwidth), on the NIC instead of NVLink."""
    wl = Workload(64, 8, 512, Lengths("fixed", 512))
    layout = Layout(dp=16, zero=0)
    one, two = (replace(hardware("h100"), devices_per_node=n) for n in (16, 8))
    within = cost.training(Q7, layout, wl, one, "actor")
    across = cost.training(Q7, layout, wl, two, "actor")
    grads = mem.GRAD_B * mem.params_per_device(Q7, layout)
    hw = one
    by_hand = 2 * 15 * ((hw.inter_node_latency - hw.intra_node_latency)
                        + grads / 16 * (1 / (hw.inter_node_bw * hw.comm_eff)
                                        - 1 / (hw.intra_node_bw * hw.comm_eff)))
    assert by_hand > 0.1  # seconds: 30 GB of gradients, 400 Gb/s against 450 GB/s
    assert math.isclose(across.comm_s - within.comm_s, by_hand, rel_tol=1e-9)
    assert across.seconds > within.seconds


def test_the_planner_keeps_tensor_and_context_parallel_groups_inside_a_node():
    wl = Workload(64, 8, 512, Lengths("fixed", 2048))
    _, name, per = parse_gpus("4x2xH100")
    found = search(Q7, "grpo", wl, replace(hardware(name), devices_per_node=per), 8)
    layouts = [x for p in found.ranked for x in [*p.plan.layouts.values(), p.gen_layout] if x]
    assert layouts and max(x.tp * x.cp for x in layouts) == 2
