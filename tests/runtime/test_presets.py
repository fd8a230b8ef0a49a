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


def test_dpo_scores_held_out_pairs_from_the_eval_file(tmp_path, tiny, capsys):
    """TRL's DPO evaluation: before training the policy is the reference, so every implicit
    reward is 0 (pair accuracy 0: ties); training on the evaluated pairs (the tiny model does
    not generalise to new ones) lowers their loss below log 2 and moves the margin to the
    chosen responses."""
    import math

    import rlloom

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({
        "prompt": p.prompt, "chosen": p.solution,
        "rejected": p.solution.replace(f"A:{p.answer}", f"A:{int(p.answer) + 1}")}) + "\n"
        for p in generate("arith", 16, seed=3, difficulty=1)))
    result = rlloom.train(overrides=[*tiny, "algo=dpo", "train.lr=3e-3", "eval.every=2",
                                     "train.steps=6", "train.prompts_per_step=8",
                                     f"data.preference_file={pairs}",
                                     f"run_dir={tmp_path / 'dpo'}"],
                          eval_dataset=str(pairs))
    assert "held-out pair accuracy" in capsys.readouterr().out
    assert result.eval_before == 0.0
    evals = [r for r in result.metrics if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"] and evals[-1]["eval/loss"] < math.log(2)
    for row in evals:
        assert row["eval/margin"] == pytest.approx(row["eval/chosen_reward"]
                                                   - row["eval/rejected_reward"])
        assert "eval_accuracy" not in row
    assert evals[-1]["eval/margin"] > 0 and result.eval_after == evals[-1]["eval/pref_accuracy"]


def test_preference_eval_of_the_reference_itself_by_hand(tiny):
    from rlloom.config import load_config
    from rlloom.data.preferences import PreferencePair
    from rlloom.models.hf_io import load_model, load_tokenizer
    from rlloom.runtime.default_model import ensure_default_model
    from rlloom.runtime.stages.offline import preference_eval

    cfg = load_config(None, [*tiny, "algo.preference_loss=ipo"])
    path = ensure_default_model(cfg)
    model, tok = load_model(path), load_tokenizer(path)
    pairs = [PreferencePair(f"Q:{a}+1=", f"A:{a + 1}", f"A:{a + 2}") for a in range(70)]
    out = preference_eval(model, model, tok, pairs, cfg.algo)
    # IPO's loss at zero margin is (0 - 1 / (2 beta))^2, over 70 pairs in two batches
    assert out["eval/loss"] == pytest.approx((1 / (2 * cfg.algo.beta)) ** 2)
    assert out["eval/margin"] == 0.0 and out["eval/pref_accuracy"] == 0.0 == out["score"]


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
