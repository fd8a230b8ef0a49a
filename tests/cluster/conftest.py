"""One namespace Ray cluster (netns.py) for the tests of this directory: a head, where the
driver runs, and two worker nodes of 2 CPUs. Each xdist worker that runs one of these tests
starts its own (the namespaces are named by process), so they are kept in one module; the
cluster stops with the module (idle, its 3 nodes' daemons would burn ~40 CPU-s by the end of
the session)."""
import pytest
from netns import NamespaceCluster, NamespaceError

pytest.importorskip("ray")
pytest.importorskip("psutil")


@pytest.fixture(scope="module")
def ns_cluster(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    root = tmp_path_factory.mktemp("nscluster")
    # the driver's private files: the whole test session's temp dir (its model cache too)
    try:
        # fast health checks, so a lost node is declared dead within seconds
        cluster = NamespaceCluster(root, base, nodes=2, cpus=2, env={
            "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "1000"}).up()
    except NamespaceError as e:
        pytest.skip(f"no namespace cluster on this machine: {e}")
    yield cluster
    cluster.down()
