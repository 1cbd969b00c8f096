"""Splitting a batch into microbatches and merging per-microbatch outputs back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import torch

Batch = torch.Tensor | Mapping[str, object]
"""A batch: a tensor, or a dict of tensors (split along dimension 0) and other values."""

_T = TypeVar("_T")


def batch_size(batch: Batch) -> int:
    """Size of dimension 0 shared by every tensor of ``batch``.

    Raises:
        TypeError: ``batch`` is not a tensor or a dict holding tensors.
        ValueError: The tensors disagree on dimension 0, or one is a scalar.
    """
    if isinstance(batch, torch.Tensor):
        tensors = {"<batch>": batch}
    elif isinstance(batch, Mapping):
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            raise TypeError(f"a dict batch must hold at least one tensor, got keys {list(batch)}")
    else:
        raise TypeError(
            f"a batch must be a tensor or a dict of tensors, got {type(batch).__name__}"
        )
    sizes = {}
    for name, t in tensors.items():
        if t.dim() == 0:
            raise ValueError(
                f"batch tensor {name!r} is a scalar; batch tensors need a batch dimension 0"
            )
        sizes[name] = t.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension 0: {sizes}")
    return next(iter(sizes.values()))


def resolve_num_microbatches(
    size: int, num_microbatches: int | None, microbatch_size: int | None
) -> int:
    """The number of microbatches for a batch of ``size`` samples.

    Raises:
        ValueError: Neither or inconsistent settings, or a batch that does not divide.
    """
    if num_microbatches is None and microbatch_size is None:
        raise ValueError("give num_microbatches or microbatch_size to the schedule")
    if num_microbatches is not None:
        if size % num_microbatches:
            raise ValueError(
                f"the batch of {size} samples does not split into num_microbatches="
                f"{num_microbatches} equal microbatches; use a batch size that is a multiple "
                f"of {num_microbatches} or change num_microbatches"
            )
        if microbatch_size is not None and size != num_microbatches * microbatch_size:
            raise ValueError(
                f"num_microbatches={num_microbatches} x microbatch_size={microbatch_size} = "
                f"{num_microbatches * microbatch_size} does not match the batch size {size}"
            )
        return num_microbatches
    assert microbatch_size is not None
    if size % microbatch_size:
        raise ValueError(
            f"the batch of {size} samples does not split into microbatches of "
            f"microbatch_size={microbatch_size}; use a batch size that is a multiple of "
            f"{microbatch_size} or change microbatch_size"
        )
    return size // microbatch_size


def split_batch(batch: Batch, num_microbatches: int) -> list[Batch]:
    """Cut every tensor of ``batch`` along dimension 0 into ``num_microbatches`` equal parts.

    Non-tensor values of a dict batch are given to every microbatch unchanged.
    """
    size = batch_size(batch)
    step = size // num_microbatches
    if isinstance(batch, torch.Tensor):
        return [batch[i * step : (i + 1) * step] for i in range(num_microbatches)]
    return [
        {
            k: (v[i * step : (i + 1) * step] if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()
        }
        for i in range(num_microbatches)
    ]


def merge_outputs(outputs: Sequence[_T]) -> _T | None:
    """Concatenate per-microbatch outputs along dimension 0 (recursively through containers).

    The result has the structure (and type) of each output; None when there are none.
    Scalar tensors are stacked; non-tensor leaves are kept from the first microbatch.
    """
    return cast("_T | None", _merge(outputs))


def _merge(outputs: Sequence[Any]) -> Any:
    if not outputs:
        return None
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(outputs)) if first.dim() == 0 else torch.cat(list(outputs), dim=0)
    if isinstance(first, Mapping):
        return {k: _merge([o[k] for o in outputs]) for k in first}
    if isinstance(first, (list, tuple)):
        merged = [_merge([o[i] for o in outputs]) for i in range(len(first))]
        return merged if isinstance(first, list) else tuple(merged)
    return first
