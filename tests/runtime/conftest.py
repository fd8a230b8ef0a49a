"""One local Ray instance shared by every Ray test of a test process (8 CPUs on 2 cores: groups
of several one-thread ranks oversubscribe them, as Ray allows). Starting one takes seconds, so
it is started once per session (per xdist worker), not per module; runs that start Ray
themselves join it (`ray.cluster.Cluster` leaves a running instance alone)."""
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    temp = tempfile.mkdtemp(prefix="rlr-", dir="/tmp")  # short: Ray's socket path limit
    ray.init(num_cpus=8, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
