"""`train.device` resolved against the machine, with CUDA reported missing (these tests run
the same on a machine with a GPU)."""
import pytest
import torch

from rlloom.config import ConfigError, load_config
from rlloom.runtime.device import resolve_device, torchrun_device
from rlloom.runtime.executor.interface import RunOptions
from rlloom.runtime.executor.preflight import ray_problems


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_and_cpu_resolve_to_the_cpu(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert torchrun_device("auto") == torch.device("cpu")
    assert torchrun_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_cuda_names_key_and_fix(no_cuda, name):
    fix = (rf"train.device={name} but torch.cuda.is_available\(\) is False \(torch .*\): "
           "install a CUDA build of torch or set train.device=cpu")
    with pytest.raises(ConfigError, match=fix):
        resolve_device(name)
    if name == "cuda":
        with pytest.raises(ConfigError, match=fix):
            torchrun_device(name)


def test_torchrun_picks_the_gpu_itself():
    with pytest.raises(ConfigError, match="under torchrun each process uses cuda:LOCAL_RANK"):
        torchrun_device("cuda:1")


def test_ray_ranks_get_a_gpu_each_where_the_cluster_has_gpus():
    from rlloom.runtime.executor.ray.cluster import worker_device
    assert any("train.device=cuda:1: on Ray every rank gets a GPU of its own" in p
               for p in ray_problems(load_config(None, ["train.device=cuda:1"]), RunOptions()))
    for device in ("auto", "cuda", "cpu"):
        assert ray_problems(load_config(None, [f"train.device={device}"]), RunOptions()) == []
    assert worker_device("auto", 8) == torch.device("cuda")
    assert worker_device("cpu", 8) == worker_device("auto", 0) == torch.device("cpu")
    with pytest.raises(ConfigError, match="the Ray cluster has no GPUs"):
        worker_device("cuda", 0)
