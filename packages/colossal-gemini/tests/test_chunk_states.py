"""Tensor states: the legal transitions, and illegal ones refused with a naming message."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.gemini import LEGAL_TRANSITIONS, Chunk, IllegalStateTransition, TensorState

S = TensorState


def test_contract_transitions_are_legal() -> None:
    # Catches a transition the chunk life cycle needs being left out of the table.
    needed = {
        (S.FREE, S.HOLD), (S.HOLD, S.FREE), (S.HOLD, S.COMPUTE), (S.COMPUTE, S.HOLD),
        (S.COMPUTE, S.HOLD_AFTER_BWD), (S.HOLD_AFTER_BWD, S.COMPUTE),
        (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE), (S.HOLD, S.READY_FOR_REDUCE),
        (S.COMPUTE, S.READY_FOR_REDUCE), (S.READY_FOR_REDUCE, S.HOLD),
    }
    assert needed <= LEGAL_TRANSITIONS
    # Catches skipping the gather or reducing a gradient twice being allowed by the table.
    assert (S.FREE, S.COMPUTE) not in LEGAL_TRANSITIONS
    assert (S.READY_FOR_REDUCE, S.READY_FOR_REDUCE) not in LEGAL_TRANSITIONS
    assert (S.READY_FOR_REDUCE, S.FREE) not in LEGAL_TRANSITIONS


def _chunk(accumulate_grads: bool = False) -> tuple[Chunk, nn.Parameter, nn.Parameter]:
    a, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))
    chunk = Chunk(64, None, torch.float32, keep_gathered=True, accumulate_grads=accumulate_grads)
    chunk.append("layer.weight", a)
    chunk.append("layer.bias", b)
    chunk.close()
    return chunk, a, b


def test_illegal_transition_names_tensor_and_both_states() -> None:
    chunk, a, b = _chunk()
    chunk.set_state(a, S.COMPUTE)
    chunk.set_state(a, S.HOLD_AFTER_BWD)
    chunk.copy_grad(a, torch.ones(3, 4))
    assert chunk.states()[S.READY_FOR_REDUCE] == 1
    # Catches a second gradient for the same tensor silently overwriting the first.
    with pytest.raises(IllegalStateTransition) as err:
        chunk.copy_grad(a, torch.ones(3, 4))
    msg = str(err.value)
    assert "layer.weight" in msg and "READY_FOR_REDUCE -> READY_FOR_REDUCE" in msg
    assert "accumulate_grads" in msg and "legal targets from READY_FOR_REDUCE: HOLD" in msg
    assert (err.value.tensor, err.value.src, err.value.dst) == (
        "layer.weight", S.READY_FOR_REDUCE, S.READY_FOR_REDUCE)
    # Catches FREE being reachable without release() (the payload would be lying).
    with pytest.raises(IllegalStateTransition, match=r"'layer.bias': HOLD -> FREE"):
        chunk.set_state(b, S.FREE)
    with pytest.raises(TypeError, match="TensorState"):
        chunk.set_state(b, "compute")  # type: ignore[arg-type]
    assert chunk.states() == {S.FREE: 0, S.COMPUTE: 0, S.HOLD: 1, S.HOLD_AFTER_BWD: 0,
                              S.READY_FOR_REDUCE: 1}


def test_accumulate_grads_allows_a_second_gradient() -> None:
    chunk, a, _ = _chunk(accumulate_grads=True)
    chunk.copy_grad(a, torch.ones(3, 4))
    chunk.copy_grad(a, torch.full((3, 4), 2.0))
    chunk.reduce()
    # Catches the second gradient replacing instead of adding to the first.
    assert torch.equal(chunk.tensor_shard(a, "grad")[2], torch.full((12,), 3.0))
    assert chunk.states()[S.HOLD] == 2


def test_release_refused_while_a_tensor_is_in_use() -> None:
    a = nn.Parameter(torch.randn(4))
    chunk = Chunk(8, None, torch.float32)
    chunk.append("w", a)
    chunk.close()
    assert chunk.states()[S.FREE] == 1 and not chunk.is_gathered
    # Catches a state change on a released chunk (its tensor has no storage).
    with pytest.raises(IllegalStateTransition, match="'w': FREE -> COMPUTE.*gather"):
        chunk.set_state(a, S.COMPUTE)
    chunk.gather()
    chunk.set_state(a, S.COMPUTE)
    # Catches releasing the payload under an operator that is using it.
    with pytest.raises(IllegalStateTransition, match="'w': COMPUTE -> FREE"):
        chunk.release()
    assert chunk.is_gathered
    chunk.set_state(a, S.HOLD)
    chunk.release()
    assert chunk.states()[S.FREE] == 1
