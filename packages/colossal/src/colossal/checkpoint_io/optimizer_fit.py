"""Whether an optimizer checkpoint fits the optimizer it is loaded into (parameter shapes).

Every plugin refuses another model's optimizer state with the same error before anything is
loaded. The index records each parameter's global shape (``param_shapes``); for checkpoints
without it, the element-wise states that always have their parameter's shape are compared.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from colossal.checkpoint_io.index import CheckpointError

__all__ = ["ELEMENTWISE_STATES", "check_optimizer_fits", "param_shapes_entry"]

ELEMENTWISE_STATES = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "master_param")
"""States of torch's optimizers that always have their parameter's shape."""


def param_shapes_entry(shapes: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """The index entry ``param_shapes`` (parameter name -> global shape)."""
    return {name: [int(d) for d in shape] for name, shape in shapes.items()}


def check_optimizer_fits(
    index: Mapping[str, Any],
    stored_shape: Callable[[str], Sequence[int]],
    live: Mapping[str, Sequence[int]],
) -> None:
    """Raise unless every parameter has the shape it had when the checkpoint was saved.

    Args:
        index: The optimizer index (``weight_map`` and, if recorded, ``param_shapes``).
        stored_shape: The stored shape of a tensor key.
        live: This optimizer's parameter name -> global shape.

    Raises:
        CheckpointError: A parameter's shape differs (the checkpoint belongs to another
            model); names the state and both shapes.
    """
    weight_map: Mapping[str, str] = index.get("weight_map", {})
    recorded: Mapping[str, Sequence[int]] | None = index.get("param_shapes")
    for name, shape in live.items():
        want = tuple(shape)
        if recorded is not None:
            if name not in recorded or tuple(recorded[name]) == want:
                continue
            saved = tuple(recorded[name])
            keys = [k for k in weight_map if k.rpartition(".")[0] == name]
            key = next((k for k in keys if tuple(stored_shape(k)) == saved), None)
            _refuse(key or name, saved, want, "optimizer state" if key else "parameter")
        for state in ELEMENTWISE_STATES:
            key = f"{name}.{state}"
            if key in weight_map:
                stored = tuple(stored_shape(key))
                if stored and stored != want:
                    _refuse(key, stored, want, "optimizer state")


def _refuse(key: str, stored: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
    raise CheckpointError(
        f"{what} {key!r} has shape {stored} in the checkpoint but the parameter has {want}: "
        "the checkpoint belongs to another model"
    )
