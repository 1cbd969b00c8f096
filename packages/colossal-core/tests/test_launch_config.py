"""ColossalAI's old ``config`` argument: accepted by every launcher, ignored, warned about once."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest

from colossal.core import launch_from_openmpi, launch_from_slurm, launch_from_torch


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    launch_mod = sys.modules["colossal.core.launch"]
    monkeypatch.setattr(launch_mod, "_config_warned", False)
    recorded: list[dict[str, Any]] = []
    monkeypatch.setattr(launch_mod, "launch", lambda **kwargs: recorded.append(kwargs))
    for name, value in {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7",
        "SLURM_PROCID": "1", "SLURM_NPROCS": "2", "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    return recorded


def test_config_keyword_warns_once_and_changes_nothing(calls: list[dict[str, Any]]) -> None:
    with pytest.warns(DeprecationWarning, match="config=...\\) is ignored"):
        launch_from_torch(config={"parallel": {"tensor": 2}}, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second config is not warned about again
        launch_from_torch(config="config.py", seed=3)
        launch_from_torch(seed=3)  # and no config, no warning
    assert len(calls) == 3
    assert all(c["rank"] == 1 and c["world_size"] == 2 and c["seed"] == 3 for c in calls)
    assert all(c["backend"] is None for c in calls)


@pytest.mark.parametrize("launcher", [launch_from_slurm, launch_from_openmpi])
def test_old_positional_config_first(launcher: Any, calls: list[dict[str, Any]]) -> None:
    with pytest.warns(DeprecationWarning):
        launcher({}, "node0", 29511)  # ColossalAI's launch_from_*(config, host, port)
    launcher("node0", 29511)  # today's form
    assert [(c["host"], c["port"], c["backend"]) for c in calls] == [("node0", 29511, None)] * 2


def test_positional_config_to_launch_from_torch(calls: list[dict[str, Any]]) -> None:
    with pytest.warns(DeprecationWarning):
        launch_from_torch({})  # ColossalAI's launch_from_torch(config)
    launch_from_torch("gloo")  # a backend is still a backend
    assert [c["backend"] for c in calls] == [None, "gloo"]
