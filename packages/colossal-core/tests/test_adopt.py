"""Loaded optimizer states end up in memory the optimizer owns, not in the file's mapping.

Catches: an optimizer keeping tensors read with ``safe_open`` (views of a private memory map
of the checkpoint file): they change when the file is rewritten in place, the job dies with
SIGBUS when it is truncated, and the first step copies every page on write.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from colossal.core.io import adopt_optimizer_state, adopt_tensors


def _mapped(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - not a dict


def _stepped_adam(seed: int) -> tuple[torch.optim.Adam, list[torch.nn.Parameter]]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    opt = torch.optim.Adam(params, lr=0.1)
    sum((p * p).sum() for p in params).backward()
    opt.step()
    return opt, params


def _overwrite_in_place(path: str) -> None:
    """Rewrite every byte after the header, as ``cp other path`` would."""
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        header = 8 + int.from_bytes(file.read(8), "little")
        file.seek(header)
        file.write(b"\x7f" * (size - header))


def test_adopted_tensors_are_copied_into_the_current_ones(tmp_path: Any) -> None:
    path = str(tmp_path / "s.safetensors")
    saved = {"exp_avg": torch.randn(50), "exp_avg_sq": torch.rand(7, 3)}
    save_file(saved, path)
    current = {"exp_avg": torch.zeros(50), "exp_avg_sq": torch.zeros(3, 7), "step": 3}
    adopted = adopt_tensors(current, {**_mapped(path), "step": 5})
    assert adopted["exp_avg"] is current["exp_avg"]  # same shape: copied into, no new memory
    assert adopted["exp_avg_sq"] is not current["exp_avg_sq"]  # other shape: a fresh clone
    assert adopted["step"] == 5
    _overwrite_in_place(path)
    for key, value in saved.items():  # the file changed under them; the adopted did not
        torch.testing.assert_close(adopted[key], value, rtol=0, atol=0)


def _loaded_from_mapped_file(tmp_path: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(reference state dict, the same read back through a memory map, the file)."""
    source, _ = _stepped_adam(seed=0)
    reference = source.state_dict()
    path = str(tmp_path / "optim.safetensors")
    save_file({f"{i}.{k}": v for i, s in reference["state"].items() for k, v in s.items()}, path)
    mapped = _mapped(path)
    loaded = {
        "state": {i: {k: mapped[f"{i}.{k}"] for k in s} for i, s in reference["state"].items()},
        "param_groups": reference["param_groups"],
    }
    return reference, loaded, path


def test_a_stepped_optimizer_keeps_its_state_tensors_through_a_load(tmp_path: Any) -> None:
    reference, loaded, path = _loaded_from_mapped_file(tmp_path)
    target, params = _stepped_adam(seed=1)
    before = {i: target.state[p]["exp_avg"] for i, p in enumerate(params)}
    target.load_state_dict(adopt_optimizer_state(target, loaded))
    _overwrite_in_place(path)
    for i, p in enumerate(params):
        assert target.state[p]["exp_avg"] is before[i]
        for key, value in reference["state"][i].items():
            torch.testing.assert_close(target.state[p][key], value, rtol=0, atol=0)


def test_a_fresh_optimizer_gets_owned_copies(tmp_path: Any) -> None:
    reference, loaded, path = _loaded_from_mapped_file(tmp_path)
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(32))]
    fresh = torch.optim.Adam(params, lr=0.1)
    fresh.load_state_dict(adopt_optimizer_state(fresh, loaded))
    _overwrite_in_place(path)
    for i, p in enumerate(params):
        for key, value in reference["state"][i].items():
            torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)
