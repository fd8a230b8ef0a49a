"""Published runs of peer frameworks against the model (docs/performance-model.md section 11):
every fixture row with a `priced:` block, priced with catalogue efficiencies and after one
calibration on one run.

    python bench/published_runs.py [--anchor RUN_ID]
"""
import argparse
from pathlib import Path

from rlloom.perf.validation.published import load_runs, table

FIXTURE = Path(__file__).parent.parent / "tests" / "perf" / "published_runs.yaml"

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchor", default="verl_fa_qwen25math7b_colocate_sync_32",
                   help="the run the calibration is fitted to")
    print(table(load_runs(FIXTURE), p.parse_args().anchor))
