"""bench/layouts.py end to end at its smallest size: the layouts train the same model to the same
losses, and the measured model state is what the fp32 ZeRO formulas predict."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlloom.perf.model.hardware import Hardware

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
        "--vocab", "48", "--batch", "4", "--seq", "16", "--steps", "1"]


def test_bench_layouts_tiny(tmp_path: Path) -> None:
    # A made-up machine: the test checks the bench runs, not this machine's speed.
    hw = tmp_path / "hw.json"
    Hardware("test", {"fp32": 1e11, "bf16": 1e11}, mem_gib=8, mem_bw=1e10, intra_node_bw=1e9,
             inter_node_bw=1e9, devices_per_node=1, extra={"threads": 1.0, "cpus": 2.0}
             ).save(hw)
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "layouts.py"), *TINY, "--layouts",
                    "single", "dp2-zero3", "--hardware", str(hw), "--json",
                    str(out)], check=True, cwd=ROOT, capture_output=True, timeout=120)
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    single, zero3 = rows["single"], rows["dp2-zero3"]
    for r in rows.values():
        assert r["step_s"] > 0 and r["predicted"]["step_s"] > 0 and r["rss"] > 0
        assert r["loss_last"] == pytest.approx(single["loss_last"], abs=1e-5)
    assert zero3["state"] == pytest.approx(single["state"] / 2, rel=0.05)
    # The perf shape leaves out the q/k norm weights: a few hundred of 22k parameters.
    for r in rows.values():
        assert r["state"] == pytest.approx(r["predicted"]["state_fp32"], rel=0.03)
