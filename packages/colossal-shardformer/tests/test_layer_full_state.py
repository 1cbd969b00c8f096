"""enable_full_state_dict: whole tensors out of state_dict, parts into load_state_dict."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colossal.core.testing import distributed_test
from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row, enable_full_state_dict


@distributed_test(2)
def test_state_dict_is_the_plain_models_and_loads_back(rank: int, world_size: int) -> None:
    """Catches a state dict of local parts (the plain model could not load it) and a load that
    copies the whole tensor instead of this rank's part."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 4))
    reference = {k: v.clone() for k, v in plain.state_dict().items()}
    group = dist.group.WORLD
    sharded = nn.Sequential(
        Linear1D_Col.from_native_module(plain[0], group),
        nn.ReLU(),
        Linear1D_Row.from_native_module(plain[2], group),
    )
    enable_full_state_dict(sharded)
    state = sharded.state_dict()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    # Load a plain model's (changed) state dict: each rank keeps its rows / columns.
    changed = {k: v * 2 + 1 for k, v in reference.items()}
    sharded.load_state_dict(changed)
    rows = slice(3 * rank, 3 * rank + 3)
    assert torch.equal(sharded[0].weight, changed["0.weight"][rows])
    assert torch.equal(sharded[2].weight, changed["2.weight"][:, rows])
    for key, value in sharded.state_dict().items():
        assert torch.equal(value, changed[key]), key
