"""ColossalAI's test helpers under our names: spawn_with_port, the decorators, the comparisons."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from colossal.core import launch
from colossal.core.accelerator import CpuAccelerator
from colossal.core.comm import all_reduce
from colossal.core.testing import (
    DistributedTestError,
    DummyDataloader,
    assert_equal_in_group,
    assert_hf_output_close,
    check_state_dict_equal,
    clear_cache_before_run,
    distributed_test,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    run_on_environment_flag,
    seed_all,
    skip_if_not_enough_gpus,
    spawn_with_port,
)


def _launch_myself(rank: int, world_size: int, port: int, scale: int) -> tuple[bool, int, float]:
    was_launched = dist.is_initialized()
    launch(rank, world_size, "localhost", port, backend="gloo", verbose=False)
    t = torch.tensor([float(rank + 1) * scale])
    all_reduce(t)
    return was_launched, int(os.environ["MASTER_PORT"]) - port, float(t.item())


def test_spawn_with_port_calls_before_launch() -> None:
    """Catches: a group launched before the function (its own launch would then fail), a
    port that is not the one the function gets, keyword arguments not forwarded."""
    values = spawn_with_port(_launch_myself, 2, scale=10)
    assert values == [(False, 0, 30.0), (False, 0, 30.0)]


def _fail(rank: int, world_size: int, port: int) -> None:
    raise KeyError(f"planted on rank {rank}")


def test_spawn_with_port_reports_the_rank_error() -> None:
    """Catches: a failing rank swallowed or reported without its traceback."""
    with pytest.raises(DistributedTestError, match="planted on rank"):
        spawn_with_port(_fail, 1)
    with pytest.raises(ValueError, match="nprocs must be a positive int, got 0"):
        spawn_with_port(_fail, 0)


def test_parameterize_runs_the_cartesian_product() -> None:
    """Catches: only the last decorator's values run, the order of the loops swapped, the
    other keyword arguments dropped."""
    seen: list[tuple[int, str, str]] = []

    @parameterize("a", [1, 2])
    @parameterize("b", ["x", "y", "z"])
    def record(a: int, b: str, tag: str) -> None:
        seen.append((a, b, tag))

    record(tag="t")
    assert seen == [(a, b, "t") for a in (1, 2) for b in ("x", "y", "z")]
    with pytest.raises(TypeError, match="got the string 'ab'"):
        parameterize("a", "ab")
    with pytest.raises(ValueError, match="no values given for 'a'"):
        parameterize("a", [])


def test_rerun_on_exception_retries_until_success_or_max_try() -> None:
    """Catches: no retry, one retry too many (max_try counts all attempts), retrying an
    error whose message does not match the pattern."""
    calls = []

    @rerun_on_exception(exception_type=RuntimeError, pattern="^flaky", max_try=3)
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("flaky: try again")
        return "done"

    assert flaky() == "done" and len(calls) == 3
    calls.clear()

    @rerun_on_exception(exception_type=RuntimeError, pattern="^flaky", max_try=2)
    def always() -> None:
        calls.append(1)
        raise RuntimeError("other line\nflaky forever")

    with pytest.raises(RuntimeError, match="flaky forever"):
        always()
    assert len(calls) == 2
    calls.clear()

    @rerun_on_exception(exception_type=RuntimeError, pattern="^flaky")
    def different() -> None:
        calls.append(1)
        raise RuntimeError("a real failure")

    with pytest.raises(RuntimeError, match="a real failure"):
        different()
    assert len(calls) == 1
    with pytest.raises(ValueError, match="max_try must be >= 1"):
        rerun_on_exception(max_try=0)


def test_rerun_if_address_is_in_use_retries_only_that_error() -> None:
    """Catches: retrying every failure (a real bug would run five times), or not retrying
    the taken-port error the spawned ranks report."""
    calls = []

    @rerun_if_address_is_in_use()
    def port_taken_once() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise DistributedTestError("rank 0 of 2 failed:\nRuntimeError: Address already in use")
        return len(calls)

    assert port_taken_once() == 2
    calls.clear()

    @rerun_if_address_is_in_use()
    def real_bug() -> None:
        calls.append(1)
        raise DistributedTestError("rank 1 of 2 failed:\nAssertionError: wrong gradient")

    with pytest.raises(DistributedTestError, match="wrong gradient"):
        real_bug()
    assert len(calls) == 1


def test_clear_cache_before_run_resets_the_peak() -> None:
    """Catches: the decorator not resetting the peak (the function would see the 256 MiB
    allocated before it)."""
    acc = CpuAccelerator()
    big = torch.ones(256 * 2**20, dtype=torch.uint8)
    del big
    peak_before = acc.max_memory_allocated()

    @clear_cache_before_run()
    def measure() -> int:
        return acc.max_memory_allocated()

    assert measure() < peak_before - 128 * 2**20


def test_check_state_dict_equal() -> None:
    """Catches: a differing tensor, key, dtype or plain value accepted; a difference far
    below the loose tolerance (1e-3) refused."""
    state = {
        "state": {0: {"step": 3, "exp_avg": torch.arange(4.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    same = {
        "state": {0: {"step": 3, "exp_avg": torch.arange(4.0) + 1e-5}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    check_state_dict_equal(state, same)
    other = {**same, "state": {0: {"step": 3, "exp_avg": torch.arange(4.0) + 0.1}}}
    with pytest.raises(AssertionError, match=r"state\.0\.exp_avg"):
        check_state_dict_equal(state, other)
    with pytest.raises(AssertionError, match=r"param_groups\[0\]\.lr: 0.1 != 0.2"):
        check_state_dict_equal(state, {**same, "param_groups": [{"lr": 0.2, "params": [0]}]})
    with pytest.raises(AssertionError, match="only in the first: \\['param_groups'\\]"):
        check_state_dict_equal(state, {"state": same["state"]})
    half = {"w": torch.ones(2, dtype=torch.bfloat16)}
    with pytest.raises(AssertionError, match="dtype"):
        check_state_dict_equal({"w": torch.ones(2)}, half)
    check_state_dict_equal({"w": torch.ones(2)}, half, ignore_dtype=True)


def test_seed_all_reproduces_every_generator() -> None:
    """Catches: a generator left unseeded (its draw would differ after reseeding)."""
    seed_all(1234)
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    seed_all(1234)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    seed_all(4321)
    assert random.random() != first[0]


@distributed_test(2)
def test_assert_equal_in_group(rank: int, world_size: int) -> None:
    """Catches: ranks with different tensors accepted (the check would compare only its own)."""
    assert_equal_in_group(torch.arange(6.0).view(2, 3))
    with pytest.raises(AssertionError, match="group ranks 0 and 1"):
        assert_equal_in_group(torch.full((2,), float(rank)))


def test_assert_hf_output_close() -> None:
    """Catches: a differing nested tensor accepted, ignore_keys not skipping, a path that
    does not name the difference."""
    out = {"logits": torch.ones(2, 3), "hidden": (torch.zeros(2), torch.ones(2)), "n": 1}
    same = {"logits": torch.ones(2, 3) + 1e-7, "hidden": (torch.zeros(2), torch.ones(2)), "n": 1}
    assert_hf_output_close(out, same)
    other = {**same, "hidden": (torch.zeros(2), torch.ones(2) * 2)}
    with pytest.raises(AssertionError, match=r"\.hidden\.1"):
        assert_hf_output_close(out, other)
    assert_hf_output_close(out, other, ignore_keys=["hidden"])
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_hf_output_close(torch.ones(2), torch.ones(3))


def test_dummy_dataloader_skip_and_environment_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a loader of the wrong length or that runs out after one pass, a CPU job
    skipped by the GPU-count guard, the environment flag read the wrong way round."""
    counter = iter(range(100))
    loader = DummyDataloader(lambda: next(counter), length=3)
    assert len(loader) == 3 and list(loader) == [0, 1, 2] and list(loader) == [3, 4, 5]
    ran: list[int] = []

    @skip_if_not_enough_gpus(min_gpus=8)
    def needs_eight() -> None:
        ran.append(1)

    monkeypatch.setenv("COLOSSAL_ACCELERATOR", "cpu")
    needs_eight()
    assert ran == [1]
    monkeypatch.delenv("MY_SLOW_FLAG", raising=False)
    assert run_on_environment_flag("my_slow_flag").args[0] is True  # skipped
    monkeypatch.setenv("MY_SLOW_FLAG", "1")
    assert run_on_environment_flag("my_slow_flag").args[0] is False
