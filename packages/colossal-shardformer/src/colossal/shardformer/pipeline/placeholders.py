"""Parameter-free stand-ins for the modules another pipeline stage owns.

A stage keeps the model's own ``forward``; the modules it does not hold are replaced by a
:class:`StagePlaceholder` of one of four kinds, chosen by the stage plan:

* ``"absent"``: never called on this stage (a call raises, naming the module and stage);
* ``"identity"``: returns its first argument (a final norm on a stage that is not the last);
* ``"input"``: returns the hidden state this stage received (the embedding of a stage that is
  not the first); the stage forward hands it over with :meth:`StagePlaceholder.receive`;
* ``"zero"``: returns a scalar 0, so ``inputs_embeds + pos_embeds`` is unchanged.

A placeholder holds no parameter; for forwards that read a weight's dtype (ViT reads
``embeddings.patch_embeddings.projection.weight.dtype``) it may carry zero-size,
non-persistent buffers of that dtype at the same dotted paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from colossal.shardformer.policies.base_policy import PolicyMap

__all__ = [
    "PLACEHOLDER_KINDS",
    "StagePlaceholder",
    "is_placeholder",
    "resolve_path",
    "skip_placeholders",
]

PLACEHOLDER_KINDS = ("absent", "identity", "input", "zero")
"""Kinds a :class:`StagePlaceholder` can be."""


class StagePlaceholder(nn.Module):
    """Stands in for a module held by another pipeline stage (see the module docstring).

    Args:
        kind: One of :data:`PLACEHOLDER_KINDS`.
        name: The dotted name of the module it replaces (for messages).
        original: The replaced module's class name.

    Raises:
        ValueError: An unknown ``kind``.
    """

    def __init__(self, kind: str, name: str, original: str = "") -> None:
        super().__init__()
        if kind not in PLACEHOLDER_KINDS:
            raise ValueError(
                f"placeholder kind {kind!r} for {name!r} is not one of {PLACEHOLDER_KINDS}"
            )
        self.kind = kind
        self.name = name
        self.original = original
        self._received: torch.Tensor | None = None

    def add_dtype_probe(self, dotted: str, like: torch.Tensor) -> None:
        """Expose a zero-size buffer at ``dotted`` with ``like``'s dtype (never its data)."""
        *path, leaf = dotted.split(".")
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        device = torch.device("cpu") if like.device.type == "meta" else like.device
        probe = torch.empty(0, dtype=like.dtype, device=device)
        owner.register_buffer(leaf, probe, persistent=False)

    @contextlib.contextmanager
    def receive(self, hidden: torch.Tensor) -> Iterator[None]:
        """Make an ``"input"`` placeholder return ``hidden`` inside the ``with`` block."""
        self._received = hidden
        try:
            yield
        finally:
            self._received = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Behave as this placeholder's kind says."""
        if self.kind == "absent":
            raise RuntimeError(
                f"{self.name} ({self.original}) belongs to another pipeline stage and was "
                "called on this one; the stage plan must give it a placeholder kind other "
                "than 'absent' (identity, input or zero)"
            )
        if self.kind == "input":
            if self._received is None:
                raise RuntimeError(
                    f"{self.name}: the stage-input placeholder was called outside the stage "
                    "forward; call the model chunk itself"
                )
            return self._received
        first = args[0] if args else next(iter(kwargs.values()), None)
        if self.kind == "identity":
            return first
        device = first.device if isinstance(first, torch.Tensor) else None
        return torch.zeros((), device=device)

    def extra_repr(self) -> str:
        """Kind and replaced module, for ``repr``."""
        return f"kind={self.kind!r}, replaces={self.name!r} ({self.original})"


def is_placeholder(module: object) -> bool:
    """Whether ``module`` stands in for a module of another pipeline stage."""
    return isinstance(module, StagePlaceholder)


def resolve_path(module: nn.Module, dotted: str) -> object:
    """``module.<dotted>``, stopping at a placeholder on the way (None when absent)."""
    current: object = module
    for part in dotted.split(".") if dotted else []:
        current = getattr(current, part, None)
        if current is None:
            return None
        if is_placeholder(current):
            return current
    return current


def skip_placeholders(model: nn.Module, policy: PolicyMap) -> PolicyMap:
    """Drop the replacements of ``policy`` that land on (or inside) a placeholder.

    A pipeline stage holds placeholders where other stages' modules were; the tensor-parallel
    policy must not turn them into parallel layers. Descriptions are dropped when, for every
    instance of their key class in ``model``, the suffix resolves to a placeholder.

    Args:
        model: The model chunk being sharded.
        policy: Module class (or name) -> ``ModulePolicyDescription``; modified in place.

    Returns:
        ``policy``.
    """
    if not any(is_placeholder(m) for m in model.modules()):
        return policy
    for key, desc in policy.items():
        instances = [
            m
            for m in model.modules()
            if (type(m) is key if isinstance(key, type) else type(m).__name__ == key)
        ]
        if not instances:
            continue
        desc.sub_module_replacement[:] = [
            d
            for d in desc.sub_module_replacement
            if not all(is_placeholder(resolve_path(m, d.suffix)) for m in instances)
        ]
    return policy
