"""One local Ray instance shared by every Ray test of a test process (8 CPUs on 2 cores: groups
of several one-thread ranks oversubscribe them, as Ray allows). Starting one takes seconds, so
it is started once per session (per xdist worker), not per module; runs that start Ray
themselves join it (`ray.cluster.Cluster` leaves a running instance alone), and a run that
ended cleanly leaves its ranks to the next run's groups of the same shape
(`RLLOOM_KEEP_RAY_WORKERS`, `ray/pool.py`): a rank's start costs ~3 CPU-seconds."""
import os
import shutil
import tempfile

import pytest

from rlloom.runtime.executor.ray.pool import KEEP_ACROSS_RUNS


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    os.environ[KEEP_ACROSS_RUNS] = "1"
    temp = tempfile.mkdtemp(prefix="rlr-", dir="/tmp")  # short: Ray's socket path limit
    ray.init(num_cpus=8, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
