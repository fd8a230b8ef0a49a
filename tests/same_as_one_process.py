"""The check every multi-rank run's test makes: its metrics equal the one-process run's, step
for step (float64 models, so only reduction order differs)."""
import json
import math

TIMING = {"gen_s", "assess_s", "train_s", "step_s"}
RAY_ONLY = {"staleness", "staleness_hist", "dropped", "behaviour_kl", "sync_s", "sync_bytes",
            "reshard_s", "reshard_bytes"}
# tp=2 splits the key/value heads; float64 leaves only reduction-order differences (~1e-16);
# a TP layout samples with the plain decode loop, so the one process does too; the soft
# overlong penalty spreads the tiny model's rewards so the runs really train; held-out
# evaluation before step 1 and after step 3, of 4 tokens: a group's greedy decode costs per
# token, not per prompt (3 evaluations of 16 tokens were a quarter of a kept rank's run)
EXACT = ["model.kv_heads=2", "model.dtype=float64", "rollout.engine=plain",
         "algo.overlong=penalty", "train.steps=3", "eval.every=3", "eval.max_new_tokens=4"]


def rows(run):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING | RAY_ONLY}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same(expected, got):
    """Equal within 1e-6 (absolute, or relative for large values); prints the largest
    difference. The models run in float64 but sampling log-probs and entropies are float32,
    so those statistics differ at the 1e-8 to 3e-7 level (the one process shares each prompt's
    pass, a group cuts plain micro-batches)."""
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    worst = (0.0, (0, ""))
    for a, b in zip(expected, got):
        assert set(a) == set(b)
        for key, value in a.items():
            if isinstance(value, float):
                assert math.isclose(value, b[key], rel_tol=1e-6, abs_tol=1e-6), (a["step"], key)
                worst = max(worst, (abs(value - b[key]), (a["step"], key)))
            else:
                assert value == b[key], (a["step"], key)
    print(f"largest difference from one process: {worst[0]:.2e} at step/key {worst[1]}")
