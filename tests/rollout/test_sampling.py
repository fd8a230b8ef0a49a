import math

import torch

from rlloom.rollout.sampling import SamplingParams, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def draws(params, n=4000):
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample(LOGITS.expand(n, 4), params, g)
    return torch.bincount(tokens, minlength=4).float() / n


def test_greedy_and_top_k_1_pick_the_mode():
    assert draws(SamplingParams(temperature=0.0), 10).tolist() == [1, 0, 0, 0]
    assert draws(SamplingParams(top_k=1), 50).tolist() == [1, 0, 0, 0]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # 0.5 + 0.3 = 0.8 >= 0.75: tokens 2 and 3 are dropped, 0 and 1 renormalised to 5/8, 3/8
    freq = draws(SamplingParams(top_p=0.75))
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.625) < 0.03


def test_top_k_2():
    freq = draws(SamplingParams(top_k=2))
    assert freq[2] == 0 and freq[3] == 0


def test_logprob_is_of_the_tempered_untruncated_policy():
    _, lp = sample(LOGITS, SamplingParams(temperature=2.0, top_k=1), None)
    tempered = torch.log_softmax(LOGITS / 2.0, -1)
    assert math.isclose(lp.item(), tempered[0, 0].item(), rel_tol=1e-6)


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one():
    from rlloom.models.tokenizer import build_char_tokenizer
    from rlloom.runtime.stages.batch import encode

    tok = build_char_tokenizer()
    assert tok.decode(encode(tok, ["Q:1+1="])[0]) == "Q:1+1="
    tok.chat_template = ("{% for m in messages %}U:{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}|R:{% endif %}")
    assert tok.decode(encode(tok, ["Q:1+1="])[0]) == "U:Q:1+1=|R:"
