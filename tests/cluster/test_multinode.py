"""Runs on a Ray cluster of three namespace "machines" (conftest.py): the driver on the head,
`rlloom train --ray-address` as a user types it, groups on two worker nodes that cannot see
the driver's files (its model cache included) but share /mnt. Each run equals the one-process
run (float64, gloo) and a lost node is named and resumed from."""
import json
import os
import re
import threading
import time

import pytest
from same_as_one_process import EXACT, assert_same, rows
from tiny_run import TINY

from rlloom.cli import main

# a user's reward function (the reward, alone: TRL's default weights)
TOKENS = '''
def n_tokens(completion_ids, **columns):
    return [len(ids) / 16 for ids in completion_ids]
'''
SPLIT = ["plan.placement=disaggregated", "plan.layouts.actor.dp=2", "plan.layouts.actor.zero=3",
         "plan.layouts.generation.tp=2"]
ONE_CPU_A_RANK = ["--group-cpus", "generation=1,actor=1"]


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    """The run's settings: no reference model (kl 0), so the groups fit 2 nodes of 2 CPUs
    exactly, and a reward function in a file only the driver sees."""
    reward = tmp_path_factory.mktemp("driver-only") / "rewards.py"
    reward.write_text(TOKENS)
    return [*TINY, *EXACT, "algo=grpo", "algo.kl_coef=0",
            f"reward.functions=[{reward}:n_tokens]"]


@pytest.fixture(scope="module")
def single(tmp_path_factory, run_args):
    out = tmp_path_factory.mktemp("single")
    main(["train", *run_args, f"run_dir={out}"])
    return rows(out)


def _train(cluster, run_args, name, overrides, options, timeout_s=300):
    """`rlloom train` on the head; its run directory on the shared storage."""
    argv = ["rlloom", "train", *run_args, *overrides, f"run_dir=/mnt/{name}",
            "--ray-address", cluster.address, "--worker-timeout", "60", *options]
    done = cluster.run("head", argv, timeout_s,
                       env={"RLLOOM_CACHE": os.environ["RLLOOM_CACHE"]})
    print(done.stdout[-3000:])
    return done


def _placement(out):
    """group -> node IP per rank, from the driver's placement line."""
    line = next(x for x in out.splitlines() if x.startswith("placement on"))
    return {g: ips.split() for g, ips in re.findall(r"(\w+) \[([^\]]+)\]", line)}


def test_a_group_spanning_two_nodes_equals_one_process(ns_cluster, run_args, single):
    """One colocated group of 2 ranks, one per node (2 CPUs each): the actor's data-parallel
    ranks meet across the bridge and generation is a TP copy split over the two machines
    (which the planner never proposes, so the run warns)."""
    done = _train(ns_cluster, run_args, "span",
                  ["plan.layouts.actor.dp=2", "plan.layouts.generation.tp=2"],
                  ["--group-cpus", "2"])
    assert done.returncode == 0
    [(group, ips)] = _placement(done.stdout).items()
    assert len(set(ips)) == 2
    # it runs, and the user is told the TP copy's every layer crosses the link
    assert f"warning: group {group!r} has tensor/context-parallel groups of 2 ranks" in done.stdout
    assert_same(single, rows(ns_cluster.shared / "span"))


def test_a_run_dir_the_nodes_cannot_see_is_refused(ns_cluster, run_args, tmp_path):
    """The driver's own disk is not shared storage: training ranks on the other nodes could
    not write their checkpoint shards there, so the run stops before it starts."""
    argv = ["rlloom", "train", *run_args, *SPLIT, f"run_dir={tmp_path / 'private-run'}",
            "--ray-address", ns_cluster.address, *ONE_CPU_A_RANK]
    done = ns_cluster.run("head", argv, 300, env={"RLLOOM_CACHE": os.environ["RLLOOM_CACHE"]})
    assert done.returncode != 0
    assert "is not visible on node 10.231." in done.stdout
    assert "writes and reads its checkpoint shards" in done.stdout
    assert not (tmp_path / "private-run" / "metrics.jsonl").exists()


def test_groups_on_two_nodes_equal_one_process_and_a_lost_node_is_resumed(ns_cluster, run_args,
                                                                          single):
    """Generation (tp2) on one node, training (dp2, ZeRO-3) on the other; the built-in model,
    in the driver's private cache, and the reward function's file reach both through the
    object store. Every process of one worker node is then killed once step 1 is written:
    the driver names the group, rank and node, waits for the node to rejoin (`ray start`
    again 3 s later) and resumes from the step-1 checkpoint on the shared storage with the
    uninterrupted numbers. (One run shows both: up to the loss it is the clean two-node
    run, which a run of its own would repeat.)"""
    metrics = ns_cluster.shared / "lost" / "metrics.jsonl"

    def lose_node2():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count("\n") >= 1:
                ns_cluster.kill("node2")
                time.sleep(3)
                ns_cluster.start("node2")
                return
            time.sleep(0.02)
    thread = threading.Thread(target=lose_node2)
    thread.start()
    done = _train(ns_cluster, run_args, "lost", SPLIT, [*ONE_CPU_A_RANK, "--max-restarts", "1"])
    thread.join()
    assert done.returncode == 0
    where = _placement(done.stdout)  # the first placement, before the loss
    assert len(set(where["generation"])) == 1 and len(set(where["actor"])) == 1
    assert set(where["generation"]) != set(where["actor"])
    shipped = [x for x in done.stdout.splitlines() if "shipped through the object store" in x]
    assert len(shipped) >= 2 and all("rewards.py" in x and "models/" in x for x in shipped)
    [failure] = [json.loads(x) for x in
                 (ns_cluster.shared / "lost" / "failures.jsonl").read_text().splitlines()]
    assert failure["node"] == ns_cluster.ip("node2") and failure["state"] == "died"
    assert f"of group '{failure['group']}' on node {ns_cluster.ip('node2')}" in done.stdout
    print(f"lost node {failure['node']}: group {failure['group']} rank {failure['rank']} at "
          f"step {failure['step']}, detected after {failure['detected_after_s']}")
    assert_same(single, rows(ns_cluster.shared / "lost"))
