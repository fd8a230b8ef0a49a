import pytest

from rlloom.config import ConfigError, apply_override, load_config


def test_defaults_then_file_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("algo:\n  kl_coef: 0.05\nrollout:\n  temperature: 0.7\n")
    cfg = load_config(f, ["rollout.temperature=0.9", "train.steps=7"])
    assert cfg.algo.kl_coef == 0.05          # from the file
    assert cfg.rollout.temperature == 0.9    # override beats file
    assert cfg.train.steps == 7
    assert cfg.rollout.n_samples == 8        # default


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError,
                       match=r"unknown key 'algo.kl_cof'; did you mean 'algo.kl_coef'"):
        load_config(None, ["algo.kl_cof=0.1"])
    f = tmp_path / "run.yaml"
    f.write_text("rollot:\n  n_samples: 4\n")
    with pytest.raises(ConfigError,
                       match=r"(?s)run.yaml.*unknown key 'rollot'; did you mean 'rollout'"):
        load_config(f)


def test_unknown_key_inside_a_role_layout():
    with pytest.raises(ConfigError, match=r"'plan.layouts.actor.tpp'; did you mean "
                                          r"'plan.layouts.actor.tp'"):
        load_config(None, ["plan.layouts.actor.tpp=2"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"rollout.temperature: .*valid number.*'hot'"):
        load_config(None, ["rollout.temperature=hot"])


def test_malformed_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("algo:\n  kl_coef: 0.1\n  epochs: [1, 2\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+:\d+: malformed YAML"):
        load_config(f)


def test_impossible_combinations_explain_the_fix():
    with pytest.raises(ConfigError, match=r"set rollout.n_samples>=2"):
        load_config(None, ["rollout.n_samples=1"])
    with pytest.raises(ConfigError, match=r"set rollout.temperature>0"):
        load_config(None, ["rollout.temperature=0"])
    with pytest.raises(ConfigError, match=r"algo.minibatches=5 must divide the 24 rollouts"):
        load_config(None, ["train.prompts_per_step=3", "algo.minibatches=5"])
    with pytest.raises(ConfigError, match=r"data.task=math has no built-in problems"):
        load_config(None, ["data.task=math"])
    with pytest.raises(ConfigError, match=r"staleness=2 needs plan.schedule=async"):
        load_config(None, ["plan.staleness=2"])


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        apply_override({}, "algo.kl_coef")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_device_spellings():
    assert load_config().train.device == "auto"
    for name in ("cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"train.device={name}"]).train.device == name
    with pytest.raises(ConfigError, match=r"train.device: use auto, cpu, cuda or cuda:N "
                                          r"\(got 'gpu'\)"):
        load_config(None, ["train.device=gpu"])


def test_trl_and_verl_names_point_to_rlloom_keys():
    for given, ours in (("rollout.num_generations=8", "rollout.n_samples"),
                        ("train.learning_rate=1e-6", "train.lr"),
                        ("algo.kl_loss_coef=0.001", "algo.kl_coef")):
        with pytest.raises(ConfigError, match=rf"unknown key '{given.split('=')[0]}'; rlloom "
                                              rf"calls it '{ours}'"):
            load_config(None, [given])


def test_evaluation_decodes_as_long_as_training_unless_told():
    assert load_config(None, ["rollout.max_new_tokens=256"]).eval.max_new_tokens == 256
    assert load_config(None, ["rollout.max_new_tokens=256",
                              "eval.max_new_tokens=32"]).eval.max_new_tokens == 32
    assert load_config(None, []).eval.max_new_tokens == 64


def test_relative_paths_become_absolute_so_a_run_resumes_from_anywhere(tmp_path, monkeypatch):
    from rlloom.config import dump_config
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["data.task=math", "data.prompt_file=data/train.jsonl",
                             "model.path=models/mine"])
    assert cfg.data.prompt_file == str(tmp_path / "data" / "train.jsonl")
    assert cfg.model.path == str(tmp_path / "models" / "mine")
    saved = tmp_path / "run" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(dump_config(cfg))
    monkeypatch.chdir("/")
    again = load_config(saved)
    assert (again.data.prompt_file, again.model.path) == (cfg.data.prompt_file, cfg.model.path)
