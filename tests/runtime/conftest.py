"""A local Ray instance shared by the tests of one module (8 CPUs on 2 cores: groups of
several one-thread ranks oversubscribe them, as Ray allows)."""
import shutil
import tempfile

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    temp = tempfile.mkdtemp(prefix="rlr-", dir="/tmp")  # short: Ray's socket path limit
    ray.init(num_cpus=8, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
