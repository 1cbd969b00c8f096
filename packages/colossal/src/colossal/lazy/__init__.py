"""colossal.lazy: build models without allocating their weights, materialize them later.

Example:
    >>> from colossal.lazy import LazyInitContext
    >>> with LazyInitContext():
    ...     model = build_model()
    >>> LazyInitContext.materialize(model)
"""

from __future__ import annotations

from colossal.lazy.context import LazyInitContext, is_lazy, lazy_to, materialize_tensor

__all__ = ["LazyInitContext", "is_lazy", "lazy_to", "materialize_tensor"]
