"""A run started as `rlloom train ARGS` in a process of its own and signalled once it has
logged two steps, as a scheduler preempting it would."""
import signal
import subprocess
import sys
import time
from pathlib import Path


def signal_after_two_steps(args: list[str], run: Path, sig: signal.Signals,
                           start_s: float) -> tuple[int, str]:
    """(exit status, stderr) of the run; `start_s` bounds the wait for its second step."""
    proc = subprocess.Popen([sys.executable, "-m", "rlloom", "train", *args, f"run_dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + start_s
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err
