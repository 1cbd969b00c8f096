"""Test helpers for every Colossal package: spawned gloo runs that never hang.

Also ColossalAI's test helpers under our names (``colossalai.testing`` serves them):
``spawn_with_port`` (its ``spawn``), ``parameterize``, ``rerun_on_exception``,
``rerun_if_address_is_in_use``, ``clear_cache_before_run``, ``check_state_dict_equal``,
``assert_close`` / ``assert_close_loose``, ``assert_equal_in_group``,
``assert_hf_output_close``, ``skip_if_not_enough_gpus``, ``run_on_environment_flag``,
``DummyDataloader`` and ``seed_all``.
"""

from torch.testing import assert_close

from colossal.core.testing.compare import (
    assert_close_loose,
    assert_equal,
    assert_not_equal,
    assert_rel_close,
    relative_error,
)
from colossal.core.testing.data import DummyDataloader
from colossal.core.testing.decorators import (
    clear_cache_before_run,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    run_on_environment_flag,
    skip_if_not_enough_gpus,
)
from colossal.core.testing.group_checks import assert_equal_in_group
from colossal.core.testing.procs import LeftoverProcessError, run_isolated
from colossal.core.testing.pytest_support import distributed_test
from colossal.core.testing.seeding import seed_all
from colossal.core.testing.spawn import (
    DistributedTestError,
    free_port,
    spawn,
    spawn_with_port,
)
from colossal.core.testing.state_dict import assert_hf_output_close, check_state_dict_equal

__all__ = [
    "DistributedTestError",
    "DummyDataloader",
    "LeftoverProcessError",
    "assert_close",
    "assert_close_loose",
    "assert_equal",
    "assert_equal_in_group",
    "assert_hf_output_close",
    "assert_not_equal",
    "assert_rel_close",
    "check_state_dict_equal",
    "clear_cache_before_run",
    "distributed_test",
    "free_port",
    "parameterize",
    "relative_error",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "run_isolated",
    "run_on_environment_flag",
    "seed_all",
    "skip_if_not_enough_gpus",
    "spawn",
    "spawn_with_port",
]
