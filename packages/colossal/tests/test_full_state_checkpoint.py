"""Checkpoint IO on a tensor-parallel model whose ``state_dict()`` is whole.

:func:`colossal.shardformer.layer.enable_full_state_dict` makes ``state_dict()`` gather each
part into the whole tensor. The checkpoint IO reads ``state_dict(keep_vars=True)`` to find the
parameters (and their sharding marks) it saves from and loads into: those must stay the
module's own parts, or a load writes into gathered copies and the model keeps its old values
while a strict load still reports success.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from colossal.checkpoint_io import CheckpointIO
from colossal.core.testing import spawn
from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row, enable_full_state_dict


def _plain(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _sharded(seed: int) -> nn.Sequential:
    model = copy.deepcopy(_plain(seed))
    model[0] = Linear1D_Col.from_native_module(model[0], None)
    model[2] = Linear1D_Row.from_native_module(model[2], None)
    return enable_full_state_dict(model)


def _roundtrip(_rank: int, _world_size: int, directory: str) -> None:
    torch.set_num_threads(1)
    source, target = _sharded(0), _sharded(1)
    io = CheckpointIO()
    io.save_model(source, directory)
    dist.barrier()
    io.load_model(target, directory)
    for (name, got), want in zip(target.named_parameters(), source.parameters(), strict=True):
        assert torch.equal(got, want), f"{name}: this rank's part was not loaded"
    whole = _plain(0).state_dict()
    for name, value in target.state_dict().items():
        assert torch.equal(value, whole[name]), f"{name}: state_dict() is not the whole tensor"
    plain = _plain(1)
    io.load_model(plain, directory)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, whole[name]), f"{name}: the plain model did not load it"


def test_checkpoint_io_loads_into_a_full_state_dict_model(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(_roundtrip, 2, args=(str(tmp_path),))
