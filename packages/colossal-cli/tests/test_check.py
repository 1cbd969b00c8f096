from __future__ import annotations

import importlib.util

import torch
from click.testing import CliRunner

import colossal.cli.check_command as check_command
from colossal.cli.installation import AcceleratorInfo, DistInfo, check_ranges
from colossal.cli.main import cli


def test_check_i_on_this_machine() -> None:
    res = CliRunner().invoke(cli, ["check", "-i"])
    assert res.exit_code == 0, res.output
    assert torch.__version__ in res.output
    assert "communication backend: gloo (available)" in res.output
    assert "Installation OK" in res.output
    if importlib.util.find_spec("colossal.kernels") is not None:
        assert "| kernel | device | implementation | loaded | why |" in res.output
        assert "| cpu_adam | cpu |" in res.output


def test_check_needs_i() -> None:
    res = CliRunner().invoke(cli, ["check"])
    assert res.exit_code == 2 and "colossal check -i" in res.output


def test_check_ranges() -> None:
    torch_version = torch.__version__
    dist = DistInfo("colossal-x", "0.1.0", ("torch>=2.4", "torch<1", "colossal-nope>=1", "rich"))
    checks = check_ranges([dist])
    assert [(c.requirement, c.installed, c.ok) for c in checks] == [
        ("torch>=2.4", torch_version, True),
        ("torch<1", torch_version, False),
        ("colossal-nope>=1", None, False),
    ]


def test_version_conflict_is_broken(monkeypatch) -> None:
    bad = DistInfo("colossal-x", "0.1.0", ("colossal-nope>=9",))
    monkeypatch.setattr(check_command, "colossal_distributions", lambda: [bad])
    res = CliRunner().invoke(cli, ["check", "-i"])
    assert res.exit_code == 1
    assert "colossal-x requires colossal-nope>=9 but it is not installed" in res.output
    assert "pip install 'colossal-nope>=9'" in res.output


def test_missing_backend_is_broken(monkeypatch) -> None:
    info = AcceleratorInfo("cuda", "cuda:0", 1, "nccl", False)
    monkeypatch.setattr(check_command, "accelerator_info", lambda: info)
    res = CliRunner().invoke(cli, ["check", "-i"])
    assert res.exit_code == 1
    assert "the nccl backend of torch.distributed is not available" in res.output
