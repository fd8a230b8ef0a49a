"""rlloom.train on Ray: a callable reward function and rows in memory reach the workers."""
import pytest

import rlloom

pytest.importorskip("ray")
pytestmark = pytest.mark.usefixtures("ray_cluster")


def tens(prompts, completions, completion_ids, answer, **columns):
    """A reward defined in a test module, which Ray workers cannot import."""
    return [float(len(a) == 2) for a in answer]


def test_a_callable_reward_and_in_memory_rows_train_on_ray(tmp_path, tiny):
    rows = [{"prompt": f"Q:{a}+{b}=", "answer": str(a + b)} for a in range(1, 9)
            for b in range(1, 9)]
    overrides = dict(arg.split("=", 1) for arg in tiny if not arg.startswith(
        ("data.difficulty", "data.train_size", "data.eval_size")))
    result = rlloom.train(overrides={**overrides, "plan.placement": "disaggregated",
                                     "train.steps": 2, "run_dir": str(tmp_path / "run")},
                          reward_funcs=[tens], train_dataset=rows, eval_dataset=rows[-8:])
    assert [r["step"] for r in result.metrics] == [1, 2]
    # the share of answers with two digits among the sampled prompts (a+b >= 10)
    assert all(0 <= r["reward/tens"] <= 1 for r in result.metrics)
    assert result.metrics[-1]["eval/tens"] == pytest.approx(
        7 / 8)  # 8+1 .. 8+8: all but 9 have two digits
