import torch

from rlloom.models.config import ModelConfig
from rlloom.models.transformer import CausalLM
from rlloom.rollout.generate import generate
from rlloom.rollout.sampling import SamplingParams
from rlloom.runtime.stages.batch import response_logprobs

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]


def test_greedy_with_cache_equals_without(model):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    a = generate(model, PROMPTS, params, eos_id=2, pad_id=0)
    b = generate(model, PROMPTS, params, eos_id=2, pad_id=0, use_cache=False)
    assert torch.equal(a.response_ids, b.response_ids)
    assert len(set(map(tuple, a.response_ids.tolist()))) > 1


def test_greedy_batched_equals_one_prompt_at_a_time(model):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    batch = generate(model, PROMPTS, params, eos_id=2, pad_id=0)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], params, eos_id=2, pad_id=0)
        n = alone.response_lengths[0]
        assert torch.equal(batch.response_ids[i, :n], alone.response_ids[0, :n])


def test_sampling_is_reproducible_and_logprobs_match_trainer(model):
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=20)
    a = generate(model, PROMPTS, params, 2, 0, torch.Generator().manual_seed(7))
    b = generate(model, PROMPTS, params, 2, 0, torch.Generator().manual_seed(7))
    assert torch.equal(a.response_ids, b.response_ids)
    with torch.no_grad():
        lp, _, _ = response_logprobs(model, a, 0.8)
    assert ((lp - a.logprobs) * a.response_mask).abs().max() < 1e-5


def test_stops_at_eos_and_pads_after():
    cfg = ModelConfig(family="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4)
    m = CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.lm_head.weight[2, :] = 0.0
        m.model.norm.weight.fill_(1.0)
        m.model.embed_tokens.weight.fill_(1.0)
        m.lm_head.weight[2, 0] = 5.0      # EOS (id 2) always wins
    out = generate(m, [[3, 4]], SamplingParams(max_new_tokens=5, temperature=0.0), 2, 0)
    assert out.response_ids.tolist() == [[2]]
    assert out.finished.tolist() == [True]


def test_stops_end_sampled_rows_where_the_unstopped_ones_pass_them(model):
    """The plain loop (the path of sharded models) ends a row at its first stop token sequence
    or stop string, keeping it, as finished; every step samples every row, so each stopped
    response is the unstopped one's prefix."""
    def decode(ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    sampled = SamplingParams(max_new_tokens=16, temperature=1.0)
    ref = generate(model, PROMPTS, sampled, -1, 0, torch.Generator().manual_seed(3))
    rows = [r[:n] for r, n in zip(ref.response_ids.tolist(), ref.response_lengths.tolist())]
    text = decode(rows[0][3:5])   # a string the first response contains
    params = SamplingParams(16, 1.0, stop=(text,), stop_token_ids=((rows[1][2],),))
    out = generate(model, PROMPTS, params, -1, 0, torch.Generator().manual_seed(3),
                   decode=decode)
    for i, full in enumerate(rows):
        ends = [j + 1 for j in range(len(full))
                if text in decode(full[:j + 1]) or full[j] == rows[1][2]]
        n = ends[0] if ends else len(full)
        assert out.response_ids[i, :n].tolist() == full[:n]
        assert out.response_lengths[i] == n and bool(out.finished[i]) == bool(ends)
    assert out.finished[:2].all()
