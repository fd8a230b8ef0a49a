"""`rlloom plan` end to end: fast, torch-free, ranks feasible plans."""
import json
import subprocess
import sys


def _plan(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from rlloom.cli import main; main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'rlloom plan imported torch'")
    return subprocess.run([sys.executable, "-c", code, "plan", *args], capture_output=True,
                          text=True, check=True)


def test_plan_prints_ranked_plans_without_torch():
    out = _plan("--gpus", "64xH100", "--top", "3").stdout
    assert "qwen2.5-7b grpo on 64 x h100: searched in" in out
    assert "naive plan (co-located, data parallel only, sync)" in out


def test_plan_json_is_sorted_and_beats_naive():
    data = json.loads(_plan("--gpus", "64xH100", "--json").stdout)
    steps = [p["step_s"] for p in data["ranked"]]
    assert steps == sorted(steps)
    assert data["naive"]["step_s"] / steps[0] >= 1.3   # long-reasoning default workload


def test_unknown_model_and_hardware_are_clear_errors(capsys):
    import pytest

    from rlloom.cli import main
    for args, message in [(["--model", "foo"], "unknown model 'foo'; known: qwen2.5-0.5b"),
                          (["--gpus", "8xTPU"], "unknown hardware 'tpu'; known: a100-40gb"),
                          (["--gpus", "lots"], "must look like 64xH100")]:
        with pytest.raises(SystemExit) as e:
            main(["plan", *args])
        assert e.value.code == 2
        assert message in capsys.readouterr().err
