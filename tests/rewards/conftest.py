import pytest
from sandbox_setup import LIMITS

from rlloom.rewards.sandbox import SandboxPool


@pytest.fixture(scope="session")
def pool():
    """One pool (two judges) shared by the sandbox tests: each program gets its own box, so
    sharing the pool is itself part of what they check."""
    with SandboxPool(workers=2, limits=LIMITS) as p:
        yield p
