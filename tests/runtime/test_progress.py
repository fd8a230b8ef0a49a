"""Progress without a terminal: plain lines a log file keeps, one per step of the RL loop."""
from rlloom.runtime.outputs.progress import progress_bar


def test_plain_lines_when_stdout_is_not_a_terminal(capsys):
    with progress_bar("rl", 3, every=1) as bar:
        for reward in (0.25, 0.5, 0.75):
            bar.advance(reward=reward, kl=None)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["rl", "1/3"], ["rl", "2/3"], ["rl", "3/3"]]
    assert lines[-1].endswith("reward=0.75") and "kl" not in lines[-1]


def test_long_bars_print_about_twenty_lines_and_the_last(capsys):
    with progress_bar("sft", 900) as bar:
        for _ in range(900):
            bar.advance(loss=1.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20 and lines[-1].startswith("sft 900/900")


def test_a_resumed_bar_counts_from_where_it_stopped(capsys):
    with progress_bar("rl", 4, done=2, every=1) as bar:
        bar.advance(reward=1.0)
    assert capsys.readouterr().out.startswith("rl 3/4")


def test_the_bar_names_each_stage_as_the_step_loop_starts_it(tmp_path, tiny, monkeypatch):
    """In one process the bar hears of each stage as it opens, not after the step."""
    from contextlib import contextmanager

    from rlloom.config import load_config
    from rlloom.runtime.executor import loop
    from rlloom.runtime.executor.launch import train

    seen: list[str] = []

    class Recorder:
        def advance(self, **metrics):
            seen.append("|")

        def stage(self, name):
            if not seen or seen[-1] != name:
                seen.append(name)

    @contextmanager
    def recording(*args, **kwargs):
        yield Recorder()

    monkeypatch.setattr(loop, "progress_bar", recording)
    train(load_config(None, [*tiny, "train.steps=2", "eval.every=2", "checkpoint.every=2",
                             f"run_dir={tmp_path / 'run'}"]))
    steps = "".join(f"{s} " for s in seen).split("| ")
    assert steps[0].split()[:3] == ["generation", "assessment", "training"]
    assert "eval" in steps[1]
