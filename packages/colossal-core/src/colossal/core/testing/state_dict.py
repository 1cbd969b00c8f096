"""Nested comparisons: state dicts (``check_state_dict_equal``) and model outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from colossal.core.testing.compare import assert_close_loose

__all__ = ["assert_hf_output_close", "check_state_dict_equal"]


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


def assert_hf_output_close(
    out1: object,
    out2: object,
    ignore_keys: Sequence[str] | None = None,
    track_name: str = "",
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Fail unless two (Hugging Face) model outputs match (ColossalAI's check).

    Mappings (``ModelOutput`` included) by key, skipping ``ignore_keys``; lists and tuples
    element by element; tensors with ``atol``/``rtol``; anything else with ``==``.

    Raises:
        AssertionError: The first difference, named by its path (``.logits``, ``.1``).
    """
    ignored = set(ignore_keys or ())
    if isinstance(out1, Mapping) and isinstance(out2, Mapping):
        if set(out1) != set(out2):
            raise AssertionError(f"{track_name}: keys differ: {sorted(out1)} vs {sorted(out2)}")
        for key in out1:
            if key not in ignored:
                assert_hf_output_close(
                    out1[key], out2[key], ignore_keys, f"{track_name}.{key}", atol, rtol
                )
    elif isinstance(out1, (list, tuple)) and isinstance(out2, (list, tuple)):
        if len(out1) != len(out2):
            raise AssertionError(f"{track_name}: lengths differ: {len(out1)} vs {len(out2)}")
        for i, (a, b) in enumerate(zip(out1, out2, strict=True)):
            assert_hf_output_close(a, b, ignore_keys, f"{track_name}.{i}", atol, rtol)
    elif isinstance(out1, torch.Tensor) and isinstance(out2, torch.Tensor):
        if out1.shape != out2.shape:
            raise AssertionError(
                f"{track_name}: shape mismatch: {tuple(out1.shape)} vs {tuple(out2.shape)}"
            )
        torch.testing.assert_close(
            out1, out2, atol=atol, rtol=rtol, msg=lambda m: f"{track_name}: {m}"
        )
    elif out1 != out2:
        raise AssertionError(f"{track_name}: value mismatch: {out1!r} vs {out2!r}")
