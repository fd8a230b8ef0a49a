"""A vLLM environment that an interrupted `rlloom setup vllm` left half-built is not used."""
import sys

from rlloom.rollout.vllm_env import installed, resolve_python, venv_python


def test_a_half_built_environment_is_not_taken_for_an_installed_one(tmp_path, monkeypatch):
    monkeypatch.delenv("RLLOOM_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("RLLOOM_VLLM_VENV", raising=False)
    monkeypatch.setenv("RLLOOM_CACHE", str(tmp_path))
    venv = tmp_path / "vllm-venv"
    python = venv_python(venv)
    python.parent.mkdir(parents=True)
    python.write_text("")              # `python3 -m venv` ran; pip was stopped
    assert not installed(venv)
    assert resolve_python("") == sys.executable
    (venv / ".rlloom-installed").write_text("cpu")   # what install writes last
    assert installed(venv) and resolve_python("") == str(python)
    assert resolve_python("/opt/py") == "/opt/py"
