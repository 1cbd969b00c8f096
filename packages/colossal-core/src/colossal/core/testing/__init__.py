"""Test helpers for every Colossal package: spawned gloo runs that never hang."""

from colossal.core.testing.compare import assert_rel_close, relative_error
from colossal.core.testing.procs import LeftoverProcessError, run_isolated
from colossal.core.testing.pytest_support import distributed_test
from colossal.core.testing.spawn import DistributedTestError, free_port, spawn

__all__ = [
    "DistributedTestError",
    "LeftoverProcessError",
    "assert_rel_close",
    "distributed_test",
    "free_port",
    "relative_error",
    "run_isolated",
    "spawn",
]
