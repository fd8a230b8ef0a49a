"""The planner writes only plans that run: the best plan of every placement and schedule it
ranks for 4 devices runs 2 steps as written (Ray local, gloo, 4+ ranks on 2 cores)."""
import json
from pathlib import Path

import pytest

from rlloom.cli import main
from rlloom.perf.model.hardware import hardware
from rlloom.perf.model.shapes import ModelShape
from rlloom.perf.model.workload import Lengths, Workload
from rlloom.perf.search.planner import describe, search
from rlloom.perf.search.report import plan_file

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.usefixtures("ray_cluster")

# the built-in tiny model with two KV heads, so tensor parallelism has something to split
# (held-out evaluation of 4 tokens: a group's greedy decode costs per token)
RUN = ["model.kv_heads=2", "train.prompts_per_step=8", "train.steps=2", "checkpoint.every=2",
       "eval.every=2", "eval.max_new_tokens=4", "algo.overlong=penalty"]
TINY_SHAPE = ModelShape("tiny", layers=2, hidden=32, ffn=96, heads=2, kv_heads=2, head_dim=16,
                        vocab=64, qkv_bias=False)


def _best_of_each(algo: str) -> dict[str, object]:
    found = search(TINY_SHAPE, algo, Workload(8, 4, 16, Lengths("fixed", 16)),
                   hardware("h100"), 4)
    best: dict[str, object] = {}
    for p in found.ranked:  # fastest first
        best.setdefault(f"{p.plan.placement}/{p.plan.schedule}", p)
    return best


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_every_placement_and_schedule_the_planner_ranks_runs_as_written(tmp_path, tiny, algo):
    """PPO's best plans of every placement and schedule run (a critic beside the actor, or
    its copy apart); GRPO's, which the executor runs through the same paths without a
    critic, on the two kinds of group (one for everything, one per stage)."""
    best = _best_of_each(algo)
    expected = {"colocated/sync", "disaggregated/sync", "disaggregated/fused",
                "disaggregated/async"} | ({"interleaved/sync"} if algo == "ppo" else set())
    assert set(best) == expected
    run_here = expected if algo == "ppo" else {"colocated/sync", "disaggregated/async"}
    for name, priced in best.items():
        if name not in run_here:
            continue
        plan = tmp_path / f"{name.replace('/', '-')}.yaml"
        plan.write_text(plan_file(priced, f"{algo} {name}"))
        run = tmp_path / name.replace("/", "-")
        print(f"runs as written: {describe(priced.plan, priced.gen_layout, priced.micro_batch)}")
        main(["train", str(plan), *tiny, f"algo={algo}", *RUN, f"run_dir={run}",
              "--worker-timeout", "300"])
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], name
        assert Path(run / "final" / "config.json").is_file()
