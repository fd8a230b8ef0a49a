"""Every preset runs end to end on the tiny built-in model (issue: algorithms)."""
import json

import pytest

from rlloom.algos.presets import PRESETS
from rlloom.cli import main
from rlloom.data.synthetic import generate

ONLINE = [name for name, p in PRESETS.items() if p.online]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", ONLINE)
def test_online_preset_runs_three_steps(tmp_path, tiny, preset):
    run = tmp_path / preset
    main(["train", *tiny, f"algo={preset}", f"run_dir={run}"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN
    if "critic" in PRESETS[preset].roles:
        assert all("value_loss" in r for r in rows)


def test_decoupled_ppo_runs_in_one_process_as_ppo(tmp_path, tiny):
    """On-policy, the proximal policy is the behaviour policy, so decoupled_ppo is ppo. The
    soft overlong penalty gives the groups unequal rewards, hence a nonzero loss to compare."""
    args = [*tiny, "train.steps=1", "algo.overlong=penalty"]
    main(["train", *args, "algo.policy_loss=decoupled_ppo", f"run_dir={tmp_path / 'dppo'}"])
    main(["train", *args, f"run_dir={tmp_path / 'ppo'}"])
    (got,), (want,) = _rows(tmp_path / "dppo"), _rows(tmp_path / "ppo")
    assert got["loss"] != 0
    for key in ("loss", "clip_frac", "grad_norm", "entropy", "kl"):
        assert got[key] == want[key], key


def test_ppo_with_shared_backbone_runs(tmp_path, tiny):
    run = tmp_path / "shared"
    main(["train", *tiny, "algo=ppo", "plan.actor_critic=shared", f"run_dir={run}"])
    assert all("value_loss" in r for r in _rows(run))
    assert (run / "final" / "model.safetensors").is_file()


def test_dynamic_sampling_drops_groups_without_signal(tmp_path, tiny):
    run = tmp_path / "dapo"
    main(["train", *tiny, "algo=dapo", "algo.max_sample_rounds=2", f"run_dir={run}"])
    assert all(1 <= r["sample_rounds"] <= 2 for r in _rows(run))


def test_dpo_on_a_preference_file(tmp_path, tiny, capsys):
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for p in generate("arith", 40, seed=3, difficulty=1):
            wrong = str(int(p.answer) + 1)
            f.write(json.dumps({"prompt": p.prompt, "chosen": p.solution,
                                "rejected": p.solution.replace(f"A:{p.answer}", f"A:{wrong}")})
                    + "\n")
    run = tmp_path / "dpo"
    main(["train", *tiny, "algo=dpo", f"data.preference_file={pairs}", "train.lr=1e-3",
          f"run_dir={run}"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the implicit reward starts at zero margin and must move towards the chosen responses
    assert rows[-1]["margin"] > 0
    # the console line leads with the loss and the reward accuracy
    line = next(x for x in capsys.readouterr().out.splitlines() if " 3/3 " in x)
    assert "loss=" in line and "pref_accuracy=" in line and "margin=" in line, line


def test_dpo_on_own_model_with_conversational_parquet_pairs(tmp_path, tiny, capsys):
    """TRL's conversational preference rows in parquet, on a model given by path: nothing to
    evaluate (pairs carry no answers), so no built-in task is evaluated in its place."""
    import datasets

    from rlloom.config import load_config
    from rlloom.runtime.default_model import ensure_default_model

    model = ensure_default_model(load_config(None, tiny))
    rows = [{"prompt": [{"role": "user", "content": p.prompt}],
             "chosen": [{"role": "assistant", "content": p.solution}],
             "rejected": [{"role": "assistant", "content": p.solution.replace(
                 f"A:{p.answer}", f"A:{int(p.answer) + 1}")}]}
            for p in generate("arith", 40, seed=3, difficulty=1)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    run = tmp_path / "dpo"
    main(["train", *tiny, "algo=dpo", f"model.path={model}", "train.lr=1e-3",
          f"data.preference_file={tmp_path / 'pairs.parquet'}",
          f"data.chat_template={tmp_path / 't.jinja'}", f"run_dir={run}"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["margin"] > 0
    assert not any("eval_accuracy" in r for r in rows)
    assert "no held-out evaluation" in capsys.readouterr().out
    assert (run / "final" / "model.safetensors").is_file()
    # config.yaml names the checkpoint trained, not the built-in model's unused settings
    recorded = (run / "config.yaml").read_text()
    assert recorded.startswith("# model trained: Qwen3ForCausalLM, 2 layers, hidden 32, ")
    assert "hidden_size" not in recorded and "kv_heads" not in recorded


def test_dpo_without_preference_file_is_refused(tiny, capsys):
    with pytest.raises(SystemExit):
        main(["train", *tiny, "algo=dpo"])
    assert "set data.preference_file" in capsys.readouterr().err


def test_overlong_filter_and_adaptive_kl(tmp_path, tiny):
    run = tmp_path / "mix"
    # 2 new tokens truncate nearly every response; truncated samples are dropped from the loss
    main(["train", *tiny, "algo=dapo", "algo.overlong=filter", "rollout.max_new_tokens=2",
          "algo.kl_coef=0.05", "algo.kl_target=0.001", f"run_dir={run}"])
    rows = _rows(run)
    assert all(r["truncated"] > 0.5 for r in rows)
    # a step trains exactly when some sample finished inside the budget
    assert all(("loss" in r) == (r["truncated"] < 1.0) for r in rows)
    # the controller moves the coefficient every step (down: the policy has not moved)
    coefs = [r["kl_coef"] for r in rows]
    assert coefs[0] == 0.05 and coefs[1] < coefs[0] and coefs[2] < coefs[1]
