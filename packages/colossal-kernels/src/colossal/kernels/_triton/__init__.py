"""Triton kernels (imported only when an implementation is loaded; Triton is optional).

On CPU tensors Triton only runs under its interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported); that is how these kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os


def triton_installed() -> bool:
    """Whether the optional ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (Triton then runs kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
