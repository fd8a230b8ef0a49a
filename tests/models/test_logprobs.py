"""Chunked log-probs and entropies equal the whole-logits computation, gradients included,
and hold one chunk's logits at a time (measured on fake tensors at a real vocabulary)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rlloom.models.logprobs import logprobs_from_logits, token_logprobs
from rlloom.rehearsal.memory import PeakMemory


def _case(temperature: float):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g, dtype=torch.float64))
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    return head, hidden, targets, temperature


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 21, 1000])
def test_chunks_equal_the_whole_logits_with_gradients(chunk: int, temperature: float) -> None:
    results = []
    for chunked in (False, True):
        head, hidden, targets, t = _case(temperature)
        if chunked:
            logp, ent = token_logprobs(head, hidden, targets, t, with_entropy=True, chunk=chunk)
        else:
            logp, ent = logprobs_from_logits(head(hidden), targets, t, with_entropy=True)
        (logp * torch.arange(21.0, dtype=torch.float64).view(3, 7)).sum().backward(
            retain_graph=True)
        (ent ** 2).sum().backward()
        results.append((logp.detach(), ent.detach(), hidden.grad, head.weight.grad))
    for whole, chunked in zip(*results):
        assert whole.shape == chunked.shape
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


def test_no_grad_and_empty_inputs() -> None:
    head, hidden, targets, _ = _case(1.0)
    with torch.no_grad():
        logp, ent = token_logprobs(head, hidden, targets, 1.0, chunk=5)
        whole, _ = logprobs_from_logits(head(hidden), targets, 1.0, False)
    assert ent is None and torch.equal(logp, whole)
    empty, _ = token_logprobs(head, hidden[:, :0], targets[:, :0], 1.0)
    assert empty.shape == (3, 0)
    with pytest.raises(ValueError, match="positive number of tokens"):
        token_logprobs(head, hidden, targets, 1.0, chunk=0)


def test_a_32k_token_response_at_vocab_152k_stays_under_the_chunk_bound() -> None:
    """Forward + backward of one 32,768-token response's log-probs and entropies at Qwen2.5's
    width and vocabulary: whole logits peak at 98 GiB here; chunked, the peak is the head's
    weight gradient, the hidden states' gradient and one chunk's
    logits at about 22 B per element (bf16 logits, fp32 copy, log-softmax, exp, the entropy's
    product and their gradients), 4.3 GiB."""
    tokens, d, vocab, chunk = 32768, 3584, 152064, 1024
    with FakeTensorMode():
        head = torch.nn.Linear(d, vocab, bias=False, dtype=torch.bfloat16)
        hidden = torch.randn(tokens, d, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (tokens,))
        with PeakMemory() as mem:
            logp, ent = token_logprobs(head, hidden, targets, 1.0, True, chunk)
            (logp.sum() + ent.sum()).backward()
    bound = 2 * d * vocab + 2 * tokens * d + 22 * chunk * vocab
    assert mem.peak <= bound
    assert mem.peak > 0.9 * bound   # the bound is the cost, not a loose ceiling
    assert mem.peak < 4.5 * 2**30
