"""A local Ray instance shared by the tests of one module."""
import shutil
import tempfile

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    temp = tempfile.mkdtemp(prefix="rlr-", dir="/tmp")  # short: Ray's socket path limit
    ray.init(num_cpus=4, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
