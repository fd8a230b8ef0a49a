"""Partial rollouts: responses decoded in chunks across weight versions keep each token's own
log-prob and version, and a chunk as long as the limit is plain generation."""
import copy

import pytest
import torch

from rlloom.config import ConfigError, load_config
from rlloom.rollout.engine import engine_generate
from rlloom.rollout.partial import PartialPool
from rlloom.rollout.sampling import SamplingParams, StopMatcher
from rlloom.runtime.stages.batch import response_logprobs

PROMPTS = [[5, 6, 7, 8], [11, 12], [13, 14, 15], [17]]
K = 2


def _chunks(pool: PartialPool, models: list, params: SamplingParams, stops: StopMatcher,
            seed: int = 0) -> None:
    """Decode one chunk of every pending row with each model in turn (version = index)."""
    for version, m in enumerate(models):
        rows = pool.pending()
        if not rows:
            return
        out = engine_generate(m, pool.requests(rows), params, eos_id=-1, pad_id=0,
                              generator=torch.Generator().manual_seed(seed + version))
        pool.absorb(rows, out, version, stops)


def _perturbed(model, versions: int) -> list:
    out = [model]
    for v in range(1, versions):
        m = copy.deepcopy(out[-1])
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(v),
                                          dtype=p.dtype))
        out.append(m)
    return out


def test_each_token_keeps_the_logprob_and_version_of_the_weights_that_sampled_it(model):
    model = model.double()
    pool = PartialPool(chunk=3, max_new_tokens=9)
    pool.admit(list(range(len(PROMPTS))), PROMPTS, K)
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    models = _perturbed(model, 3)
    _chunks(pool, models, params, StopMatcher(params, None))
    assert pool.complete() == [0, 1, 2, 3] and not pool.pending()
    problems, rollout, versions = pool.take([2, 0, 1, 3], pad_id=0)
    assert problems == [2, 0, 1, 3]
    assert rollout.response_lengths.tolist() == [9] * 8  # no EOS: every row ran 3 chunks
    assert versions == [[0, 0, 0, 1, 1, 1, 2, 2, 2]] * 8
    for v, m in enumerate(models):
        again = response_logprobs(m, rollout, 1.0)[0]
        cols = slice(3 * v, 3 * v + 3)
        assert torch.allclose(again[:, cols], rollout.logprobs[:, cols], atol=1e-10)
        if v:  # the earlier weights would give other log-probs: the test can tell them apart
            assert not torch.allclose(response_logprobs(models[v - 1], rollout, 1.0)[0][:, cols],
                                      rollout.logprobs[:, cols], atol=1e-4)


def test_a_chunk_as_long_as_the_limit_is_plain_generation(model):
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    prompts = [p for p in PROMPTS for _ in range(K)]
    whole = engine_generate(model, prompts, params, eos_id=3, pad_id=0,
                            generator=torch.Generator().manual_seed(0))
    pool = PartialPool(chunk=6, max_new_tokens=6)
    pool.admit(list(range(len(PROMPTS))), PROMPTS, K)
    out = engine_generate(model, pool.requests(pool.pending()), params, eos_id=3, pad_id=0,
                          generator=torch.Generator().manual_seed(0))
    pool.absorb(pool.pending(), out, 0, StopMatcher(params, None))
    _, rollout, _ = pool.take(pool.complete(), pad_id=0)
    for name in ("prompt_ids", "response_ids", "response_mask", "finished"):
        assert torch.equal(getattr(rollout, name), getattr(whole, name)), name
    assert torch.equal(rollout.logprobs, whole.logprobs)


def test_a_stop_sequence_across_the_chunk_boundary_ends_the_response(model):
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    free = engine_generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=6,
                                                               temperature=0.0), -1, 0)
    stop = tuple(free.response_ids[0, 1:3].tolist())  # tokens 2 and 3: either side of a cut
    params = SamplingParams(max_new_tokens=2, temperature=0.0, stop_token_ids=(stop,))
    pool = PartialPool(chunk=2, max_new_tokens=6)
    pool.admit([0], [PROMPTS[0]], 1)
    _chunks(pool, [model] * 3, params, StopMatcher(params, None))
    _, rollout, versions = pool.take(pool.complete(), pad_id=0)
    assert rollout.response_ids[0, :3].tolist() == free.response_ids[0, :3].tolist()
    assert rollout.response_lengths.tolist() == [3] and rollout.finished.tolist() == [True]
    assert versions == [[0, 0, 1]]


def test_pool_state_round_trips_and_groups_complete_oldest_first(model):
    pool = PartialPool(chunk=2, max_new_tokens=4)
    pool.admit(["a", "b"], PROMPTS[:2], K)
    params = SamplingParams(max_new_tokens=2, temperature=1.0)
    _chunks(pool, [model], params, StopMatcher(params, None))
    again = PartialPool(chunk=2, max_new_tokens=4)
    again.load_state(pool.state())
    assert [vars(r) for r in again.rows] == [vars(r) for r in pool.rows]
    again.admit(["c"], PROMPTS[2:3], K)
    _chunks(again, [model], params, StopMatcher(params, None))
    assert again.complete()[:2] == [0, 1] and again.next_group == 3


def test_partial_tokens_must_divide_the_response_limit_and_be_below_it():
    with pytest.raises(ConfigError, match=r"partial_tokens \(5\) must divide.*"
                                          r"max_new_tokens \(16\).*partial_tokens=4"):
        load_config(None, ["rollout.max_new_tokens=16", "rollout.partial_tokens=5"])
    with pytest.raises(ConfigError, match=r"partial_tokens \(16\) must be below"):
        load_config(None, ["rollout.max_new_tokens=16", "rollout.partial_tokens=16"])
