"""PPO's separate critic from a checkpoint of its own (`model.critic_path`): a smaller causal
LM's backbone with a zero head, or a reward model with its trained head (OpenRLHF's
critic_pretrain), refused when it does not read the policy's token ids."""
import json

import pytest
import torch
import transformers

from rlloom.cli import main
from rlloom.config import load_config
from rlloom.models.hf_io import load_model, save_checkpoint
from rlloom.models.tokenizer import build_char_tokenizer
from rlloom.runtime.executor.policy import build_critic

VOCAB = len(build_char_tokenizer())


def _qwen3(hidden: int, vocab: int = VOCAB, **kw) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden,
                                    intermediate_size=2 * hidden, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=hidden // 2, pad_token_id=0, **kw)


@pytest.fixture
def policy_dir(tmp_path):
    path = tmp_path / "policy"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(_qwen3(32)).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def _cfg(policy_dir, critic):
    return load_config(None, ["algo=ppo", f"model.path={policy_dir}",
                              f"model.critic_path={critic}"])


def test_reward_model_critic_starts_with_its_trained_head(tmp_path, policy_dir):
    rm = tmp_path / "rm"
    torch.manual_seed(1)
    hf = transformers.Qwen3ForSequenceClassification(_qwen3(16, num_labels=1)).eval()
    hf.save_pretrained(rm)
    build_char_tokenizer().save_pretrained(rm)
    critic = build_critic(_cfg(policy_dir, rm).model, policy_dir, load_model(policy_dir)).eval()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():   # per-position scores of HF's head, before its last-token pooling
        expected = hf.score(hf.model(input_ids=ids).last_hidden_state).squeeze(-1)
        got = critic(ids)
    assert critic.config.hidden_size == 16
    assert (got - expected).abs().max() < 1e-5 and expected.abs().max() > 1e-3


def test_causal_lm_critic_takes_its_backbone_and_a_zero_head(tmp_path, policy_dir):
    small = tmp_path / "small"
    torch.manual_seed(3)
    save_checkpoint(load_model(_save_lm(tmp_path / "src", 16)), build_char_tokenizer(), small)
    critic = build_critic(_cfg(policy_dir, small).model, policy_dir, load_model(policy_dir))
    lm = load_model(small)
    assert all(torch.equal(v, lm.model.state_dict()[k])
               for k, v in critic.model.state_dict().items())
    assert not critic.score.weight.any()


def _save_lm(path, hidden, vocab=VOCAB):
    transformers.Qwen3ForCausalLM(_qwen3(hidden, vocab)).save_pretrained(path)
    return path


def test_a_critic_of_another_vocabulary_is_refused(tmp_path, policy_dir):
    other = _save_lm(tmp_path / "other", 16, vocab=500)  # no tokenizer: rows must match
    with pytest.raises(Exception, match="must share the tokenizer"):
        build_critic(_cfg(policy_dir, other).model, policy_dir, load_model(policy_dir))


def test_critic_path_needs_a_separate_critic(tmp_path, policy_dir, capsys):
    with pytest.raises(SystemExit):
        main(["train", f"model.path={policy_dir}", f"model.critic_path={policy_dir}",
              "algo=grpo"])
    assert "has no separate critic" in capsys.readouterr().err


def test_ppo_trains_a_smaller_critic(tmp_path, tiny):
    """The built-in policy (hidden 32) with a hidden-16 critic: the run trains both, and the
    checkpoint holds the critic at its own size."""
    critic = tmp_path / "critic"
    torch.manual_seed(4)
    save_checkpoint(load_model(_save_lm(tmp_path / "src", 16)), build_char_tokenizer(), critic)
    run = tmp_path / "run"
    main(["train", *tiny, "algo=ppo", f"model.critic_path={critic}", "train.steps=2",
          f"run_dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["value_loss"] > 0 for r in rows)
    state = torch.load(next(run.glob("checkpoints/*/state.pt")), weights_only=False)
    assert state["critic"]["score.weight"].shape == (1, 16)
    assert state["critic"]["score.weight"].any()   # the zero head moved: it trained
