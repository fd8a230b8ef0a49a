"""The step loop's schedules as the order of calls it makes on its groups: the one-process
executor, wrapped by a spy that records each call's method, drives three steps of the tiny
run under each schedule."""
import pytest

from rlloom.config import load_config
from rlloom.runtime.executor.launch import local_loop

STAGES = {"generate", "assess", "assess_chunk", "finish_assessment", "train", "evaluate"}


class Recorded:
    """A group whose calls are recorded by their method's name, then run."""

    def __init__(self, inner, calls):
        self.inner, self.calls, self.spec = inner, calls, inner.spec

    @property
    def name(self):
        return self.inner.name

    def call(self, method, *args, **kwargs):
        self.calls.append(method.__name__)
        return self.inner.call(method, *args, **kwargs)


class Spy:
    """The executor with its groups recorded; one wrapper per group, since the loop tells
    groups apart by identity (assessment on the training group or not)."""

    def __init__(self, ex):
        self.ex, self.calls, self.groups = ex, [], {}

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def group(self, name):
        if name not in self.groups:
            self.groups[name] = Recorded(self.ex.group(name), self.calls)
        return self.groups[name]


def stage_calls(tmp_path, tiny, overrides):
    cfg = load_config(None, [*tiny, "eval.every=10", *overrides.split()])
    (tmp_path / "run").mkdir()
    loop = local_loop(cfg, tmp_path / "run")
    loop.ex = spy = Spy(loop.ex)
    loop.run()
    return [c for c in spy.calls if c in STAGES]


STEP = ["generate", "assess", "train"]


@pytest.mark.parametrize("schedule, expected", [
    # generate -> assess -> train, one step after the other (eval before step 1 and at the end)
    ("plan.schedule=sync", ["evaluate", *STEP * 3, "evaluate"]),
    # two generation requests per step, each chunk's assessment submitted as it arrives, the
    # advantages over the whole batch, then training
    ("plan.schedule=fused", ["evaluate", *["generate", "generate", "assess_chunk",
                                           "assess_chunk", "finish_assessment", "train"] * 3,
                             "evaluate"]),
    # staleness 1: step i+1's generation is submitted before step i trains, and nothing is
    # generated past the last step
    ("plan.schedule=async plan.staleness=1", ["evaluate", "generate", "generate", "assess", "train",
                             "generate", "assess", "train", "assess", "train", "evaluate"]),
])
def test_each_schedule_calls_the_stages_in_its_order(tmp_path, tiny, schedule, expected):
    assert stage_calls(tmp_path, tiny, schedule) == expected


def test_a_signal_after_the_checkpoint_decision_stops_at_the_next_boundary(tmp_path, tiny):
    """SIGTERM landing after a step decided not to checkpoint (here while its spans are
    collected) is a race a preempted run meets: the run goes on to the next step boundary,
    checkpoints there and names that checkpoint (it had raised IndexError: none to name)."""
    import os
    import signal

    from rlloom.runtime.stop_signals import Stopped

    class SignalOnSpans(Spy):
        def spans(self):
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGTERM))
            return self.ex.spans()

    sent = []
    cfg = load_config(None, [*tiny, "eval.every=10", "train.steps=5", "checkpoint.every=10"])
    (tmp_path / "run").mkdir()
    loop = local_loop(cfg, tmp_path / "run")
    loop.ex = SignalOnSpans(loop.ex)
    with pytest.raises(Stopped) as stop:
        loop.run()
    assert stop.value.code == 143
    assert (f"SIGTERM received: stopped after step 2 of 5, checkpoint written to "
            f"{tmp_path / 'run'}/checkpoints/step_000002") in str(stop.value)
