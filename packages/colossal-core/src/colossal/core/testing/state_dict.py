"""``check_state_dict_equal``: two (nested) state dicts hold the same keys and values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from colossal.core.testing.compare import assert_close_loose

__all__ = ["check_state_dict_equal"]


def _tensors(
    path: str, a: torch.Tensor, b: object, ignore_device: bool, ignore_dtype: bool
) -> None:
    if not isinstance(b, torch.Tensor):
        raise AssertionError(f"{path}: a tensor vs a {type(b).__name__}")
    if ignore_device:
        a, b = a.detach().cpu(), b.detach().cpu()
    elif a.device != b.device:
        raise AssertionError(f"{path}: devices differ ({a.device} vs {b.device})")
    if ignore_dtype:
        a = a.to(b.dtype)
    try:
        assert_close_loose(a, b)
    except AssertionError as error:
        raise AssertionError(f"{path}: {error}") from None


def _compare(path: str, a: object, b: object, ignore_device: bool, ignore_dtype: bool) -> None:
    if isinstance(a, Mapping):
        if not isinstance(b, Mapping):
            raise AssertionError(f"{path}: a mapping vs a {type(b).__name__}")
        if set(a) != set(b):
            only_a, only_b = sorted(map(str, set(a) - set(b))), sorted(map(str, set(b) - set(a)))
            raise AssertionError(
                f"{path or 'state dict'}: keys differ ({len(a)} vs {len(b)}); only in the "
                f"first: {only_a}, only in the second: {only_b}"
            )
        for key, value in a.items():
            _compare(
                f"{path}.{key}" if path else str(key), value, b[key], ignore_device, ignore_dtype
            )
    elif isinstance(a, torch.Tensor):
        _tensors(path, a, b, ignore_device, ignore_dtype)
    elif isinstance(a, Sequence) and not isinstance(a, (str, bytes)):
        if not isinstance(b, Sequence) or isinstance(b, (str, bytes)) or len(a) != len(b):
            raise AssertionError(f"{path}: {a!r} vs {b!r} (lengths or types differ)")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _compare(f"{path}[{i}]", x, y, ignore_device, ignore_dtype)
    elif a != b:
        raise AssertionError(f"{path}: {a!r} != {b!r} ({type(a).__name__}, {type(b).__name__})")


def check_state_dict_equal(
    d1: Mapping[str, object],
    d2: Mapping[str, object],
    ignore_device: bool = True,
    ignore_dtype: bool = False,
) -> None:
    """Fail unless ``d1`` and ``d2`` have the same keys and (loosely) equal values.

    ColossalAI's check: nested mappings and lists are compared element by element, tensors
    with ``rtol = atol = 1e-3`` (:func:`assert_close_loose`), anything else with ``==``. The
    message names the key path of the first difference (``state.0.exp_avg``).

    Args:
        d1: A (model or optimizer) state dict.
        d2: The state dict to compare it with.
        ignore_device: Compare tensors on the CPU wherever they are (else a device mismatch
            fails).
        ignore_dtype: Cast ``d1``'s tensors to ``d2``'s dtype first (else a dtype mismatch
            fails).

    Raises:
        AssertionError: The first difference, with its key path.
    """
    _compare("", d1, d2, ignore_device, ignore_dtype)
