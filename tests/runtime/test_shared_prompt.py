"""One prompt pass per distinct prompt gives the joined forward's logits (float64)."""
import torch

from rlloom.config import load_config
from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import Rollout, left_pad, right_pad
from rlloom.runtime.ranks import RankGroup
from rlloom.runtime.stages.batch import joined
from rlloom.runtime.stages.generation import Samples
from rlloom.runtime.stages.online import assess
from rlloom.runtime.stages.shared_prompt import SharedPrompts

FAMILIES = {"llama": dict(qkv_bias=True), "qwen3": dict(qk_norm=True)}


def model(family: str) -> CausalLM:
    cfg = ModelConfig(family=family, vocab_size=40, hidden_size=16, intermediate_size=32,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, **FAMILIES[family])
    m = CausalLM(cfg)
    m.init_weights(seed=0, std=0.3)
    for name, p in m.named_parameters():   # random norms and biases, so they are tested
        if "norm" in name or name.endswith("bias"):
            torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.3)
    return m.double()


def grouped_rollout(k: int = 3) -> Rollout:
    """Prompts of 2, 6 and 4 tokens (left padding differs), K samples each, responses of
    1 to 7 tokens (right padding)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (2, 6, 4)]
    p_ids, p_mask = left_pad([p for p in prompts for _ in range(k)], 0)
    lens = torch.randint(1, 8, (3 * k,), generator=g).tolist()
    r_ids, r_mask = right_pad([torch.randint(3, 40, (n,), generator=g).tolist() for n in lens],
                              0)
    return Rollout(p_ids, p_mask, r_ids, r_mask, torch.zeros(r_ids.shape, dtype=torch.float64),
                   torch.ones(3 * k, dtype=torch.bool))


def test_hidden_states_match_the_joined_forward():
    r = grouped_rollout()
    for family in FAMILIES:
        m = model(family)
        ids, mask, span = joined(r)
        with torch.no_grad():
            whole = m.hidden(ids, mask)[:, span]
            prompts = SharedPrompts(m, r, train=False)
            rows = torch.tensor([7, 0, 4, 1])    # any subset, any order
            shared = prompts.hidden(rows, r.select(rows))
        assert prompts.distinct == 3
        keep = r.response_mask[rows].bool()
        assert (shared - whole[rows])[keep].abs().max() < 1e-12


class _PairedRank(RankGroup):
    """A rank of a two-rank group whose peer needs one more micro-batch (gathers return this
    rank's part alone): the plain micro-batch path of a group, run in one process."""

    def most(self, n: int) -> int:
        return n + 1

    def gather(self, obj):
        return [obj]


def test_assessment_with_shared_prompts_equals_group_micro_batches():
    r = grouped_rollout()
    m = model("qwen3")
    cfg = load_config(None, ["algo.kl_coef=0.1"])
    s = Samples([], r, torch.arange(3).repeat_interleave(3), {}, torch.rand(9))
    a = assess(s, m, None, 0.1, None, cfg)
    b = assess(s, m, None, 0.1, None, cfg, _PairedRank(world=2))
    keep = r.response_mask.bool()  # past a row's end each path leaves what it computed
    assert (a.ref_logp - b.ref_logp)[keep].abs().max() < 1e-6
    assert a.ref_logp.abs().sum() > 0
