"""The state of each tensor in a chunk and the transitions between states.

A chunk moves its tensors through a small state machine so that gathering, releasing and
reducing happen exactly when they are safe:

* ``FREE``: the chunk's full payload is not materialized here (only this rank's shard);
* ``HOLD``: materialized and idle;
* ``COMPUTE``: an operator (forward or backward) is using it;
* ``HOLD_AFTER_BWD``: backward used it and its gradient is pending;
* ``READY_FOR_REDUCE``: its gradient is in the chunk's gradient buffer.

Staying in the same state is legal (a tied weight used twice in one forward enters
``COMPUTE`` twice), except ``READY_FOR_REDUCE -> READY_FOR_REDUCE``: a second gradient for a
tensor whose gradient is already in the buffer is a bug unless the chunk was built to
accumulate gradients into its buffer (``Chunk(accumulate_grads=True)``).
"""

from __future__ import annotations

import enum


class TensorState(enum.Enum):
    """Where a tensor of a chunk is in its forward/backward/reduce cycle."""

    FREE = "free"
    COMPUTE = "compute"
    HOLD = "hold"
    HOLD_AFTER_BWD = "hold_after_bwd"
    READY_FOR_REDUCE = "ready_for_reduce"


_S = TensorState

LEGAL_TRANSITIONS: frozenset[tuple[TensorState, TensorState]] = frozenset(
    {
        (_S.FREE, _S.HOLD),  # gather
        (_S.HOLD, _S.FREE),  # release
        (_S.HOLD, _S.COMPUTE),
        (_S.COMPUTE, _S.HOLD),
        (_S.COMPUTE, _S.HOLD_AFTER_BWD),
        (_S.HOLD_AFTER_BWD, _S.COMPUTE),  # used again in the same backward (tied weights)
        (_S.HOLD_AFTER_BWD, _S.HOLD),  # backward ended without a gradient for it
        (_S.HOLD_AFTER_BWD, _S.READY_FOR_REDUCE),
        (_S.HOLD, _S.READY_FOR_REDUCE),
        (_S.COMPUTE, _S.READY_FOR_REDUCE),
        (_S.READY_FOR_REDUCE, _S.HOLD),  # after the reduction
        # Idempotent re-entries (not READY_FOR_REDUCE: see the module docstring).
        (_S.FREE, _S.FREE),
        (_S.HOLD, _S.HOLD),
        (_S.COMPUTE, _S.COMPUTE),
        (_S.HOLD_AFTER_BWD, _S.HOLD_AFTER_BWD),
    }
)

_ACCUMULATE = (_S.READY_FOR_REDUCE, _S.READY_FOR_REDUCE)


class IllegalStateTransition(RuntimeError):  # noqa: N818 - the contract name
    """A tensor was asked to move between two states that its cycle does not connect.

    Attributes:
        tensor: Name of the tensor.
        src: The state it was in.
        dst: The state it was asked to enter.
    """

    def __init__(self, tensor: str, src: TensorState, dst: TensorState, reason: str = "") -> None:
        self.tensor, self.src, self.dst = tensor, src, dst
        targets = ", ".join(sorted(s.name for s in legal_targets(src))) or "none"
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"illegal state transition of tensor {tensor!r}: {src.name} -> {dst.name}{why}; "
            f"legal targets from {src.name}: {targets}"
        )


def legal_targets(src: TensorState, *, accumulate: bool = False) -> frozenset[TensorState]:
    """States reachable from ``src`` in one step.

    Args:
        src: The current state.
        accumulate: Whether ``READY_FOR_REDUCE -> READY_FOR_REDUCE`` is allowed.
    """
    out = {b for a, b in LEGAL_TRANSITIONS if a is src}
    if accumulate and src is _S.READY_FOR_REDUCE:
        out.add(_S.READY_FOR_REDUCE)
    return frozenset(out)


def check_transition(
    tensor: str, src: TensorState, dst: TensorState, *, accumulate: bool = False
) -> None:
    """Raise :class:`IllegalStateTransition` unless ``src -> dst`` is legal.

    Args:
        tensor: Name of the tensor, for the message.
        src: The current state.
        dst: The requested state.
        accumulate: Whether a second gradient may be accumulated (``READY_FOR_REDUCE`` again).

    Raises:
        TypeError: ``dst`` is not a :class:`TensorState`.
        IllegalStateTransition: The transition is not legal.
    """
    if not isinstance(dst, TensorState):
        raise TypeError(f"state must be a TensorState, got {dst!r} for tensor {tensor!r}")
    if (src, dst) in LEGAL_TRANSITIONS or (accumulate and (src, dst) == _ACCUMULATE):
        return
    reason = ""
    if (src, dst) == _ACCUMULATE:
        reason = "its gradient is already in the buffer; build the chunk with accumulate_grads"
    raise IllegalStateTransition(tensor, src, dst, reason)
