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
