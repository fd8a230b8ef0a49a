"""TRL's (and verl's) names mean what their users mean: each row of the table maps onto
rlloom's key, with the value converted where the meaning differs, or is refused with the
rlloom way to say it."""
import pytest

from rlloom.config import ConfigError, load_config
from rlloom.trl_names import MAPPED, REFUSED


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


VALUES = {"learning_rate": 1e-6, "num_generations": 4, "max_completion_length": 48,
          "max_prompt_length": 256, "num_iterations": 3, "epsilon": 0.25, "epsilon_high": 0.28,
          "max_grad_norm": 0.5, "lr_scheduler_type": "cosine", "save_steps": 7,
          "save_total_limit": 3, "eval_steps": 5, "max_steps": 12, "temperature": 0.7,
          "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
          "reward_weights": {"correct": 2.0},
          "report_to": ["tensorboard"], "output_dir": "runs/trl", "kl_loss_coef": 0.02,
          "ppo_epochs": 3, "clip_ratio_high": 0.3, "response_length": 40,
          "max_response_length": 40, "n": 4, "train_batch_size": 8, "reward_funcs": []}


@pytest.mark.parametrize("name", sorted(k for k, v in MAPPED.items() if isinstance(v, str)))
def test_a_trl_name_sets_rlloom_s_key(name):
    value = VALUES[name]
    cfg = load_config(None, [f"{name}={value!r}" if isinstance(value, str) else
                             f"{name}={value}"])
    assert _get(cfg, MAPPED[name]) == value


@pytest.mark.parametrize("overrides, key, value", [
    (["warmup_ratio=0.1", "max_steps=200"], "train.warmup_steps", 5),  # of the 50 RL steps
    (["warmup_ratio=0.25"], "train.warmup_steps", 10),                 # of the default 40
    (["warmup_ratio=0.01"], "train.warmup_steps", 1),  # rounded up, as transformers does
    # transformers 5's warmup_steps: optimizer steps, or below 1 a share of the steps
    (["warmup_steps=8"], "train.warmup_steps", 2),                      # 2 x 2 updates a step
    (["warmup_steps=0.1", "max_steps=200"], "train.warmup_steps", 5),
    (["lr_scheduler_type=constant", "warmup_steps=8"], "train.warmup_steps", 0),
    # a generation of 64 completions in groups of 8 is 8 prompts, made into 4 updates a pass
    (["generation_batch_size=64"], "train.prompts_per_step", 8),
    (["generation_batch_size=64", "num_generations=16"], "train.prompts_per_step", 4),
    (["steps_per_generation=4"], "algo.minibatches", 4),
    (["loss_type=dr_grpo"], "algo.loss_agg", "seq-mean-token-sum-norm"),
    (["loss_type=dapo"], "algo.loss_agg", "token-mean"),
    (["epsilon=0.3"], "algo.clip_high", 0.3),  # TRL's epsilon_high defaults to epsilon
    (["epsilon=0.3", "epsilon_high=0.28"], "algo.clip_high", 0.28),
    (["steps_per_generation=4"], "algo.epochs", 1),  # TRL's one pass
    (["steps_per_generation=4", "num_iterations=2"], "algo.epochs", 2),
    (["bf16=true"], "train.compute_dtype", "bfloat16"),
    (["bf16=false"], "train.compute_dtype", "params"),
    (["scale_rewards=true"], "algo.advantage", "grpo"),
    (["scale_rewards=none"], "algo.advantage", "dr_grpo"),
    (["beta=0.04"], "algo.kl_coef", 0.04),                             # GRPO: the KL coefficient
    # transformers' constant schedule ignores the warm-up; constant_with_warmup keeps it
    (["lr_scheduler_type=constant", "warmup_ratio=0.1"], "train.warmup_steps", 0),
    (["lr_scheduler_type=constant_with_warmup", "warmup_ratio=0.1"], "train.warmup_steps", 4),
    (["lr_scheduler_type=constant_with_warmup"], "train.lr_schedule", "constant"),
    (["lr_scheduler_type=cosine"], "train.lr_schedule", "cosine"),
])
def test_converted_names(overrides, key, value):
    assert _get(load_config(None, overrides), key) == value


def test_beta_is_dpo_s_beta_for_an_offline_preset(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Q:1+1=", "chosen": "A:2", "rejected": "A:3"}\n')
    cfg = load_config(None, ["algo=dpo", "beta=0.3", f"data.preference_file={pairs}"])
    assert (cfg.algo.beta, cfg.algo.kl_coef) == (0.3, 0.001)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_name_says_the_rlloom_way(name):
    with pytest.raises(ConfigError, match=f"'{name}' is TRL's: "):
        load_config(None, [f"{name}=1"])


def test_a_trl_name_and_its_rlloom_key_must_agree():
    with pytest.raises(ConfigError, match="learning_rate=1e-06 is TRL's name for train.lr, "
                                          "which is also set to 0.001; give one"):
        load_config(None, ["learning_rate=0.000001", "train.lr=0.001"])
    with pytest.raises(ConfigError, match="scale_rewards='batch'"):
        load_config(None, ["scale_rewards=batch"])


def test_dpo_s_beta_on_a_grpo_preset_is_refused_naming_kl_coef():
    with pytest.raises(ConfigError, match="algo.beta is DPO's inverse temperature and does "
                                          "nothing for algo=grpo; .* is algo.kl_coef"):
        load_config(None, ["algo.beta=0.04"])
    assert load_config(None, ["algo.beta=0.1"]).algo.kl_coef == 0.001  # an older config.yaml


def test_a_nested_trl_name_gets_a_hint():
    with pytest.raises(ConfigError, match="unknown key 'train.learning_rate'; rlloom calls it "
                                          "'train.lr'"):
        load_config(None, ["train.learning_rate=1e-6"])


def test_max_completion_length_reaches_evaluation_as_rollout_max_new_tokens_does():
    cfg = load_config(None, ["max_completion_length=1024"])
    assert (cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens) == (1024, 1024)
    cfg = load_config(None, ["max_completion_length=1024", "eval.max_new_tokens=50"])
    assert (cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens) == (1024, 50)


def test_every_refused_name_is_named_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["logging_steps=1", "use_vllm=true", "fp16=true"])
    assert all(f"'{n}' is TRL's: " in str(e.value) for n in ("logging_steps", "use_vllm", "fp16"))


@pytest.mark.parametrize("name, pointer", [
    ("entropy_coef", "rlloom's is algo.entropy_coef"),
    ("gradient_checkpointing", "plan.layouts.actor.activation_checkpointing=true"),
    ("weight_decay", "rlloom's is train.weight_decay"),
])
def test_a_name_rlloom_has_elsewhere_points_to_it(name, pointer):
    with pytest.raises(ConfigError, match=f"unknown key '{name}'; .*{pointer.replace('(', '.')}"):
        load_config(None, [f"{name}=1"])


def test_trl_s_list_of_reward_weights_and_report_to_none(tmp_path):
    fns = tmp_path / "fns.py"
    fns.write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n"
                   "def g(completions, **kw):\n    return [1.0] * len(completions)\n")
    cfg = load_config(None, [f"reward_funcs=[{fns}:f, {fns}:g]", "reward_weights=[0.5, 2]",
                             "report_to=none"])
    assert cfg.reward.weights == {"f": 0.5, "g": 2.0} and cfg.log.trackers == []
    with pytest.raises(ConfigError, match="reward_weights has 1 weights for 2 reward functions"):
        load_config(None, [f"reward_funcs=[{fns}:f, {fns}:g]", "reward_weights=[1]"])


@pytest.mark.parametrize("overrides, expected", [
    # TRL counts optimizer steps; num_iterations passes make one accumulated update each
    (["max_steps=100", "num_iterations=2"], {"train.steps": 50, "algo.epochs": 2,
                                              "algo.minibatches": 1}),
    # rlloom's own 2 x 2 updates per step when TRL's passes are not given
    (["max_steps=100"], {"train.steps": 25, "algo.epochs": 2, "algo.minibatches": 2}),
    (["max_steps=12", "save_steps=4", "eval_steps=8"],
     {"train.steps": 3, "checkpoint.every": 1, "eval.every": 2}),
    (["num_iterations=3", "algo.minibatches=2", "max_steps=12"],
     {"train.steps": 2, "algo.epochs": 3, "algo.minibatches": 2}),
])
def test_trl_step_counts_are_optimizer_steps(overrides, expected):
    cfg = load_config(None, overrides)
    assert {k: _get(cfg, k) for k in expected} == expected


def test_a_generation_rlloom_groups_cannot_make_is_refused():
    with pytest.raises(ConfigError, match=r"generation_batch_size=20 counts completions; .*"
                                          r"rollout.n_samples=8, which does not divide it"):
        load_config(None, ["generation_batch_size=20"])


def test_a_step_count_rlloom_steps_cannot_make_is_refused():
    with pytest.raises(ConfigError, match=r"max_steps=10 counts optimizer steps .* = 2 x 2 = 4 "
                                          r"of them, which does not divide it"):
        load_config(None, ["max_steps=10"])


def test_a_config_in_trl_s_names_is_told_once_which_defaults_differ(capsys, monkeypatch):
    from rlloom import trl_names
    monkeypatch.setattr(trl_names, "_said", set())
    load_config(None, ["learning_rate=2e-6", "beta=0.0", "max_completion_length=128"])
    err = capsys.readouterr().err
    assert err.startswith("rlloom's defaults differ from TRL's where this config sets nothing: ")
    assert "algo.loss_agg=seq-mean-token-mean (TRL's loss_type: dapo (token-mean))" in err
    assert "train.lr_schedule=constant (TRL's lr_scheduler_type: linear)" in err
    assert "algo.minibatches=2 x 2 updates per generation (TRL's num_iterations: 1" in err
    assert "compute_dtype" not in err  # auto: bfloat16 where the GPU has it, as TRL's bf16
    assert "train.lr=" not in err and "kl_coef" not in err and "max_new_tokens" not in err
    load_config(None, ["learning_rate=2e-6", "beta=0.0", "max_completion_length=128"])
    load_config(None, ["train.lr=1e-5"])  # rlloom's own names: nothing to say
    assert capsys.readouterr().err == ""


def test_print_config_ends_with_where_values_differ_from_trl_s(capsys):
    import yaml

    from rlloom.cli import main
    main(["train", "--print-config", "learning_rate=1e-6", "loss_type=dapo"])
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("#   ")]
    assert "#   algo.kl_coef=0.001 (TRL's beta: 0.0)" in comments
    assert not any(c.startswith(("#   train.lr=", "#   algo.loss_agg=")) for c in comments)
    assert yaml.safe_load(out)["train"]["lr"] == 1e-6  # still the YAML it was
