"""TRL's own config objects, and the table of TRL's names checked against TRL's source: each
name rlloom maps exists in GRPOConfig with the meaning the mapping gives it (the defaults
rlloom says differ, the optimizer steps a run makes, the learning rate at each update)."""
import dataclasses

import pytest

from rlloom.config import ConfigError
from rlloom.trl_names import GENERATION, MAPPED, OPTIMIZER_STEPS, POINTERS, REFUSED, TRL_DEFAULTS
from tests.tiny_run import TINY

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' renames


def grpo(**fields):
    return trl.GRPOConfig(use_cpu=True, **fields)  # TRL refuses bf16 on a CPU without it


# names rlloom takes that TRL 1.16's GRPOConfig does not have: verl's, the trainer's
# reward_funcs argument, and older TRL's max_prompt_length and warmup_ratio
NOT_GRPOCONFIG = {"kl_loss_coef", "ppo_epochs", "clip_ratio_high", "response_length",
                  "max_response_length", "n", "train_batch_size", "reward_funcs",
                  "max_prompt_length", "warmup_ratio", "entropy_coeff"}


def test_every_trl_name_rlloom_maps_is_a_grpoconfig_field():
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    names = {*MAPPED, *OPTIMIZER_STEPS, *GENERATION, *REFUSED, *POINTERS, "num_iterations",
             "beta"}
    assert names - fields == NOT_GRPOCONFIG


def test_the_defaults_rlloom_says_differ_are_grpoconfig_s():
    config = grpo()
    trl_values = {"learning_rate": config.learning_rate, "beta": config.beta,
                  "max_completion_length": config.max_completion_length,
                  "loss_type": f"{config.loss_type} (token-mean)",
                  "lr_scheduler_type": config.lr_scheduler_type.value,
                  "num_iterations": f"{config.num_iterations} update per generation",
                  "generation_batch_size": f"{config.generation_batch_size} completions per "
                  f"device: 1 prompt of num_generations={config.num_generations}"}
    assert {name: value for name, value, _ in TRL_DEFAULTS.values()} == trl_values


@pytest.mark.parametrize("fields", [
    {"max_steps": 100, "num_iterations": 2},
    {"max_steps": 60, "num_iterations": 3, "steps_per_generation": 2},
    {"max_steps": 48, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
     "steps_per_generation": 4, "num_generations": 4},
    {"max_steps": 30, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
])
def test_a_grpoconfig_makes_the_generations_and_optimizer_steps_trl_makes(fields):
    import rlloom
    config = grpo(**fields)
    cfg = rlloom.prepare(config).cfg
    # TRL: each generation of generation_batch_size completions is used num_iterations times,
    # in steps_per_generation micro-batches of which gradient_accumulation_steps make one
    # optimizer step
    per_generation = (config.num_iterations * config.steps_per_generation
                      // config.gradient_accumulation_steps)
    assert cfg.algo.epochs * cfg.algo.minibatches == per_generation
    assert cfg.train.steps * per_generation == config.max_steps
    assert cfg.train.prompts_per_step * cfg.rollout.n_samples == config.generation_batch_size
    assert cfg.rollout.n_samples == config.num_generations
    if "save_steps" in fields:
        assert cfg.checkpoint.every * per_generation == config.save_steps
        assert cfg.eval.every * per_generation == config.eval_steps


@pytest.mark.parametrize("schedule, warmup", [("linear", 0), ("cosine", 0), ("constant", 0.2),
                                              ("linear", 0.2), ("constant_with_warmup", 3)])
def test_the_learning_rate_of_each_update_is_trl_s(schedule, warmup):
    """transformers' scheduler, as TRL's Trainer builds it from the config, against rlloom's
    rate at each RL step, at one update per generation. rlloom's warm-up starts at lr/W where
    transformers' first update has rate 0: the same ramp one update earlier."""
    import torch
    from transformers import get_scheduler

    import rlloom
    from rlloom.algos.lr_schedule import lr_factor
    config = grpo(max_steps=20, num_iterations=1, lr_scheduler_type=schedule,
                  warmup_steps=warmup, learning_rate=1.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(schedule, opt, config.get_warmup_steps(20), 20)
    theirs = []
    for _ in range(20):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    t = rlloom.prepare(config).cfg.train
    ours = [lr_factor(s, t.steps, t.lr_schedule, t.warmup_steps) for s in range(1, 21)]
    w = t.warmup_steps
    assert w == config.get_warmup_steps(20) or schedule == "constant" and w == 0
    assert ours[w:] == pytest.approx(theirs[w:])
    assert ours[:w] == pytest.approx(theirs[1:w + 1])


def test_fields_rlloom_cannot_honour_are_refused_together():
    import rlloom
    config = grpo(logging_steps=5, use_vllm=True, weight_decay=0.1, push_to_hub=False,
                  torch_compile=True)
    with pytest.raises(ConfigError) as e:
        rlloom.prepare(config)
    text = str(e.value)
    assert text.startswith("GRPOConfig sets fields rlloom cannot honour: ")
    assert "'logging_steps' is TRL's: every step is logged" in text
    assert "'use_vllm' is TRL's: set rollout.engine=vllm" in text
    assert "'weight_decay': rlloom's is train.weight_decay" in text
    assert "'torch_compile' has no counterpart in rlloom" in text
    assert "push_to_hub" not in text  # its default: not set
    assert "torch_compile_backend" not in text  # TRL sets it from torch_compile


def test_an_object_s_trl_defaults_hold_under_the_overrides(capsys, monkeypatch):
    """The object is TRL's whole config: where TRL's defaults differ from rlloom's, its values
    hold (and nothing is said), unless an override or a chosen preset sets that key."""
    import rlloom
    from rlloom import trl_names
    monkeypatch.setattr(trl_names, "_said", set())
    cfg = rlloom.prepare(grpo(learning_rate=2e-6, epsilon=0.3)).cfg
    assert (cfg.train.lr, cfg.train.lr_schedule, cfg.algo.kl_coef) == (2e-6, "linear", 0.0)
    assert (cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens) == (512, 512)
    assert (cfg.algo.loss_agg, cfg.algo.epochs, cfg.algo.minibatches) == ("token-mean", 1, 1)
    assert (cfg.train.prompts_per_step, cfg.rollout.n_samples) == (1, 8)
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (0.3, 0.3)  # epsilon_high = epsilon
    assert capsys.readouterr().err == ""
    cfg = rlloom.prepare(grpo(), {"train.lr": 1e-5, "algo": "dr_grpo",
                                  "train.prompts_per_step": 4}).cfg
    assert (cfg.train.lr, cfg.algo.loss_agg, cfg.train.prompts_per_step) == \
        (1e-5, "seq-mean-token-sum-norm", 4)
    with pytest.raises(ConfigError, match="loss_type='bnpo': it normalises by one device's"):
        rlloom.prepare(grpo(loss_type="bnpo"))
    # an override under rlloom's own name wins over the object's default of that key
    cfg = rlloom.prepare(grpo(), {"algo.kl_coef": 0.05, "rollout.n_samples": 16}).cfg
    assert (cfg.algo.kl_coef, cfg.rollout.n_samples, cfg.train.prompts_per_step) == \
        (0.05, 16, 32)  # TRL's 8 completions are no whole group of 16: rlloom's prompts


def test_a_dpoconfig_is_the_dpo_preset(tmp_path):
    import rlloom
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "Q:1+1=", "chosen": "A:2", "rejected": "A:3"}\n')
    config = trl.DPOConfig(use_cpu=True, beta=0.3, max_steps=10, loss_type=["ipo"],
                           per_device_train_batch_size=4, gradient_accumulation_steps=2)
    cfg = rlloom.prepare(config, {"data.preference_file": str(pairs)}).cfg
    assert (cfg.algo.name, cfg.algo.beta, cfg.algo.preference_loss) == ("dpo", 0.3, "ipo")
    assert (cfg.train.steps, cfg.train.prompts_per_step) == (10, 8)
    cfg = rlloom.prepare(trl.DPOConfig(use_cpu=True, per_device_train_batch_size=2),
                         {"data.preference_file": str(pairs)}).cfg
    assert (cfg.train.prompts_per_step, cfg.train.lr) == (2, 1e-6)   # TRL's lr holds
    cfg = rlloom.prepare(trl.DPOConfig(use_cpu=True), {"data.preference_file": str(pairs)}).cfg
    assert cfg.train.prompts_per_step == 8                           # TRL's 8 per device
    with pytest.raises(ConfigError, match=r"loss_type=\['hinge'\]: rlloom's offline losses"):
        rlloom.prepare(trl.DPOConfig(use_cpu=True, loss_type=["hinge"]))


def test_an_sftconfig_trains_with_rlloom_sft(tmp_path):
    import rlloom
    out = tmp_path / "sft"
    config = trl.SFTConfig(use_cpu=True, learning_rate=1e-3, max_steps=2,
                           per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           output_dir=str(out))
    from rlloom.trl_configs import sft_overrides
    assert sft_overrides(config) == ["sft.steps=2", "sft.lr=0.001", "sft.batch_size=8"]
    # TRL's defaults hold where the object leaves them: 2e-5 and 8 per device
    assert sft_overrides(trl.SFTConfig(use_cpu=True)) == ["sft.lr=2e-05", "sft.batch_size=8"]
    assert rlloom.sft(config, [o for o in TINY if not o.startswith("sft.")]) == out
    assert (out / "config.json").is_file()
    with pytest.raises(ConfigError, match="an SFTConfig configures supervised fine-tuning"):
        rlloom.prepare(config)
    with pytest.raises(ConfigError, match="'packing' has no counterpart in rlloom"):
        rlloom.sft(trl.SFTConfig(use_cpu=True, packing=True), out=tmp_path / "other")


def test_a_grpoconfig_trains(tmp_path):
    import rlloom
    config = grpo(max_steps=2, num_iterations=1, learning_rate=1e-4,
                  output_dir=str(tmp_path / "run"), save_steps=1)
    result = rlloom.train(config, [o for o in TINY if not o.startswith(("train.steps",
                                                                         "checkpoint.every"))])
    assert result.run_dir == tmp_path / "run"
    assert [row["step"] for row in result.metrics] == [1, 2]
    assert result.final_model.is_dir()
