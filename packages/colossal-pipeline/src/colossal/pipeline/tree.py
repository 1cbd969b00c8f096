"""Flatten nested dicts / lists / tuples of tensors (and small values) into leaves and back."""

from __future__ import annotations

from typing import Any

import torch

# A spec is hashable and comparable: ("T", i) for the i-th tensor, ("V", value) for any other
# leaf, ("list" | "tuple", children) and ("dict", ((key, child), ...)).
Spec = tuple


def flatten(obj: object) -> tuple[list[torch.Tensor], Spec]:
    """Split ``obj`` into its tensors (depth first) and a spec that rebuilds it.

    Raises:
        TypeError: A leaf that is neither a tensor nor picklable-looking plain data.
    """
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Spec:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("T", len(tensors) - 1)
        if isinstance(x, dict):
            return ("dict", tuple((k, walk(v)) for k, v in x.items()))
        if isinstance(x, list):
            return ("list", tuple(walk(v) for v in x))
        if isinstance(x, tuple):
            if hasattr(x, "_fields"):
                raise TypeError(
                    f"namedtuple {type(x).__name__} cannot cross a pipeline stage; return a "
                    "tuple or a dict instead"
                )
            return ("tuple", tuple(walk(v) for v in x))
        if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.Size)):
            return ("V", x)
        raise TypeError(
            f"cannot send a {type(x).__name__} between pipeline stages; stage outputs must be "
            "tensors, or dicts / lists / tuples of tensors and plain values (None, bool, int, "
            "float, str)"
        )

    spec = walk(obj)
    return tensors, spec


def unflatten(tensors: list[torch.Tensor], spec: Spec) -> Any:
    """Rebuild the object that :func:`flatten` split into ``tensors`` and ``spec``."""
    kind, body = spec
    if kind == "T":
        return tensors[body]
    if kind == "V":
        return body
    if kind == "dict":
        return {k: unflatten(tensors, child) for k, child in body}
    children = [unflatten(tensors, child) for child in body]
    return children if kind == "list" else tuple(children)


def is_differentiable(t: torch.Tensor) -> bool:
    """Whether a tensor received between stages can carry a gradient (floating or complex)."""
    return t.is_floating_point() or t.is_complex()
