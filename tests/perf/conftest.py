import pytest

from rlloom.rollout import engine


@pytest.fixture
def engine_counts(monkeypatch):
    """What the engine runs, counted as it runs: decode steps, live rows and key positions
    read summed over them, prefill forwards, and the tokens of each extend forward."""
    seen = {"steps": 0, "live": 0, "width": 0, "prefills": 0, "extends": []}
    decode, prefill, extend = engine._Run._decode_step, engine._Run._prefill, engine._Run._extend

    def counted_decode(run):
        seen["steps"] += 1
        seen["live"] += run.live
        seen["width"] += run.width  # key positions the step's attention reads
        decode(run)

    def counted_prefill(run, groups):
        seen["prefills"] += 1
        prefill(run, groups)

    def counted_extend(run, slot, tokens):
        seen["extends"].append(len(tokens))
        return extend(run, slot, tokens)
    monkeypatch.setattr(engine._Run, "_decode_step", counted_decode)
    monkeypatch.setattr(engine._Run, "_prefill", counted_prefill)
    monkeypatch.setattr(engine._Run, "_extend", counted_extend)
    return seen
