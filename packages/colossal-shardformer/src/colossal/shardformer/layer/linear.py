"""Column- and row-parallel linear layers, from ``nn.Linear`` and GPT-2's ``Conv1D``.

A column-parallel layer splits the output features: rank ``r`` holds rows
``[r * out / tp, (r + 1) * out / tp)`` of an ``nn.Linear`` weight ``(out, in)`` (columns of a
``Conv1D`` weight ``(in, out)``) and of the bias. With ``n_fused > 1`` (GPT-2's ``c_attn``
holds q, k and v side by side) each of the ``n_fused`` segments is split, so a rank holds its
slice of q, of k and of v. A row-parallel layer splits the input features and all-reduces its
partial outputs once, then adds the (replicated) bias.

Sequence parallelism (``split_gather``) is a per-instance switch, :attr:`sequence_parallel`
(None: tensor parallelism only, unchanged): a column-parallel layer not fed by a region entry
then all-gathers the sequence shards of its input (gradient: reduce-scatter), and a
row-parallel layer reduce-scatters its partial output along the sequence instead of
all-reducing it (gradient: all-gather), so activations between them stay sequence-sharded.

Parameters keep the native names and layout, so ``state_dict()`` keys are Hugging Face's;
each sharded parameter comes from :func:`colossal.core.shard_parameter` (marked with the part
it holds of the whole, unpadded tensor; ``meta`` natives give ``meta`` shards for lazy init).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import Block, Blocks, mark_sharded, shard_parameter, shard_spec
from colossal.shardformer.layer._primitives import (
    copy_to_tp_region,
    gather_from_tp_region,
    gather_sequence_to_tp,
    is_in_tp_region,
    reduce_from_tp_region,
    reduce_scatter_sequence,
    split_to_tp_region,
)
from colossal.shardformer.layer._utils import check_divisible, group_rank, group_size

logger = logging.getLogger(__name__)

__all__ = [
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "column_part",
    "regroup_fused_output",
]


def column_part(
    shape: tuple[int, ...], dim: int, n_fused: int, tp: int, rank: int
) -> Block | Blocks:
    """This rank's part of a tensor whose ``dim`` holds ``n_fused`` segments, each split in ``tp``.

    Args:
        shape: The whole tensor's shape.
        dim: The split (output-feature) dim.
        n_fused: Equal segments along ``dim`` (3 for a fused q/k/v).
        tp: The tensor-parallel size.
        rank: This rank in the tensor-parallel group.
    """
    seg = shape[dim] // n_fused
    per = seg // tp
    blocks = tuple(
        Block.along(shape, dim, f * seg + rank * per, f * seg + (rank + 1) * per)
        for f in range(n_fused)
    )
    return blocks[0] if n_fused == 1 else Blocks(dim, blocks)


def regroup_fused_output(y: torch.Tensor, tp: int, n_fused: int) -> torch.Tensor:
    """Reorder a gathered fused output ``[r0: s0 s1 ..][r1: ..]`` into ``[s0 of all ranks] ..``."""
    if n_fused == 1 or tp == 1:
        return y
    per = y.shape[-1] // (tp * n_fused)
    lead = y.shape[:-1]
    return y.reshape(*lead, tp, n_fused, per).transpose(-3, -2).reshape(*lead, y.shape[-1])


def _check_fused(name: str, out: int, n_fused: int, tp: int) -> None:
    if not isinstance(n_fused, int) or n_fused < 1:
        raise ValueError(f"{name}: n_fused must be an int >= 1, got {n_fused!r}")
    if out % n_fused != 0:
        raise ValueError(
            f"{name}: out_features={out} does not split into n_fused={n_fused} equal segments; "
            "pass the number of fused projections the weight holds"
        )
    check_divisible(
        "out_features per fused segment" if n_fused > 1 else "out_features",
        out // n_fused,
        tp,
        name,
        "choose a tensor-parallel size that divides it",
    )


def _native_weight(module: nn.Module) -> torch.Tensor:
    """``module.weight`` of the native layer being replaced."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight must be a tensor, got {weight!r}")
    return weight


def _shard_in_place(
    native: torch.Tensor, part: Block | Blocks, group: ProcessGroup | None
) -> nn.Parameter:
    """``native`` (a module's Parameter) made to hold ``part`` of itself, marked sharded.

    ColossalAI's ``from_native_module`` keeps the native module's Parameter objects (its tests
    assert ``linear.weight is linear_col.weight``), so an optimizer built on the native
    module before the swap still updates the layer. A ``meta`` tensor (lazy init) or a plain
    tensor gets a new parameter instead, as :func:`colossal.core.shard_parameter` makes it.
    """
    sharded = shard_parameter(native, part, group)
    if not isinstance(native, nn.Parameter) or native.is_meta or shard_spec(native) is not None:
        return sharded
    spec = shard_spec(sharded)
    assert spec is not None
    native.data = sharded.data
    mark_sharded(native, spec.placements, spec.shape)
    return native


class _ParallelLinear(nn.Module):
    """Shared state of the four layers: group, sizes and the ``weight``/``bias`` parameters.

    ``_out_dim`` is the weight's output-feature dim: 0 for ``nn.Linear`` ``(out, in)``, 1 for
    ``Conv1D`` ``(in, out)``. ``sequence_parallel`` is the sequence-parallel switch: None
    (tensor parallelism only) or the state object of the sequence split (its ``batch_size``
    unflattens a ``(batch * seq, hidden)`` input).
    """

    _out_dim = 0
    sequence_parallel: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        process_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.process_group = process_group
        self.tp_size = group_size(process_group)
        self.tp_rank = group_rank(process_group)
        self.weight = weight
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias

    @classmethod
    def _native_sizes(cls, module: nn.Module) -> tuple[int, int]:
        """``(in_features, out_features)`` of the native layer (``nn.Linear``: ``(out, in)``)."""
        return int(_native_weight(module).shape[1]), int(_native_weight(module).shape[0])

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._out_dim == 0:
            return F.linear(x, self.weight, bias)
        y = torch.matmul(x, self.weight)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"tp_size={self.tp_size}, local_weight={tuple(self.weight.shape)}, "
            f"bias={self.bias is not None}"
        )


class Linear1D_Col(_ParallelLinear):  # noqa: N801 - ColossalAI's name
    """Column-parallel ``nn.Linear``: weight ``(out / tp, in)``, output features split.

    Build with :meth:`from_native_module`. The input enters the TP region (its gradient is
    all-reduced over the group) unless it is the exact tensor an :func:`enter_tp_region` hook
    already brought in for the same group.

    Attributes:
        process_group: The tensor-parallel group.
        gather_output: Whether the forward all-gathers the output to full width.
        n_fused: Fused segments in the output features.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        process_group: ProcessGroup | None,
        gather_output: bool = False,
        n_fused: int = 1,
    ) -> None:
        super().__init__(in_features, out_features, weight, bias, process_group)
        self.gather_output = bool(gather_output)
        self.n_fused = n_fused

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: ProcessGroup | None,
        gather_output: bool = False,
        n_fused: int = 1,
        **kwargs: Any,
    ) -> Linear1D_Col:
        """Shard ``module`` (an ``nn.Linear``, or a ``Conv1D`` for the GPT-2 class) by columns.

        The layer keeps ``module``'s own ``weight`` and ``bias`` Parameter objects, now holding
        this rank's part (ColossalAI's contract; a ``meta`` module gets new parameters).

        Args:
            module: The native layer; its ``weight`` may be on ``meta``.
            process_group: The tensor-parallel group (the whole job when None).
            gather_output: All-gather the output to full width in the forward.
            n_fused: The output features hold this many equal fused segments.
            **kwargs: Accepted for ColossalAI compatibility and ignored (logged).

        Raises:
            ValueError: The output features (per segment) do not divide by the TP size.
        """
        if kwargs:
            logger.debug("%s ignores %s", cls.__name__, sorted(kwargs))
        in_features, out_features = cls._native_sizes(module)
        tp, rank = group_size(process_group), group_rank(process_group)
        _check_fused(cls.__name__, out_features, n_fused, tp)
        weight = _shard_in_place(
            _native_weight(module),
            column_part(tuple(_native_weight(module).shape), cls._out_dim, n_fused, tp, rank),
            process_group,
        )
        bias = None
        native_bias = getattr(module, "bias", None)
        if native_bias is not None:
            bias = _shard_in_place(
                native_bias, column_part((out_features,), 0, n_fused, tp, rank), process_group
            )
        return cls(in_features, out_features, weight, bias, process_group, gather_output, n_fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local projection; the full output when ``gather_output`` else this rank's columns."""
        if not is_in_tp_region(x, self.process_group):
            state = self.sequence_parallel
            if state is None:
                x = copy_to_tp_region(x, self.process_group)
            else:
                batch = getattr(state, "batch_size", None)
                x = gather_sequence_to_tp(x, self.process_group, batch)
        y = self._matmul(x, self.bias)
        if self.gather_output:
            y = regroup_fused_output(
                gather_from_tp_region(y, self.process_group), self.tp_size, self.n_fused
            )
        return y

    def extra_repr(self) -> str:
        """Sizes, TP size, fusing and gathering, for ``repr``."""
        return f"{super().extra_repr()}, n_fused={self.n_fused}, gather_output={self.gather_output}"


class Linear1D_Row(_ParallelLinear):  # noqa: N801 - ColossalAI's name
    """Row-parallel ``nn.Linear``: weight ``(out, in / tp)``, one all-reduce, replicated bias.

    Attributes:
        process_group: The tensor-parallel group.
        parallel_input: Whether the input already holds this rank's slice of the features
            (else the forward keeps the slice of a full input).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        process_group: ProcessGroup | None,
        parallel_input: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, weight, bias, process_group)
        self.parallel_input = bool(parallel_input)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Module,
        process_group: ProcessGroup | None,
        parallel_input: bool = True,
        **kwargs: Any,
    ) -> Linear1D_Row:
        """Shard ``module`` by input features (rows of ``x``'s last dim).

        The layer keeps ``module``'s own ``weight`` (now this rank's part) and ``bias``
        (replicated) Parameter objects, as ColossalAI's does.

        Args:
            module: The native layer; its ``weight`` may be on ``meta``.
            process_group: The tensor-parallel group (the whole job when None).
            parallel_input: The input is already split along its last dim.
            **kwargs: Accepted for ColossalAI compatibility and ignored (logged).

        Raises:
            ValueError: The input features do not divide by the TP size.
        """
        if kwargs:
            logger.debug("%s ignores %s", cls.__name__, sorted(kwargs))
        in_features, out_features = cls._native_sizes(module)
        tp, rank = group_size(process_group), group_rank(process_group)
        check_divisible(
            "in_features",
            in_features,
            tp,
            cls.__name__,
            "choose a tensor-parallel size that divides it",
        )
        in_dim = 1 - cls._out_dim
        per = in_features // tp
        weight = _shard_in_place(
            _native_weight(module),
            Block.along(tuple(_native_weight(module).shape), in_dim, rank * per, (rank + 1) * per),
            process_group,
        )
        bias = getattr(module, "bias", None)
        return cls(in_features, out_features, weight, bias, process_group, parallel_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local partial product, one all-reduce over the group, then the bias.

        With :attr:`sequence_parallel` set, a reduce-scatter along the sequence replaces the
        all-reduce (the output holds this rank's sequence slice).
        """
        if not self.parallel_input:
            x = split_to_tp_region(x, self.process_group)
        state = self.sequence_parallel
        if state is None:
            y = reduce_from_tp_region(self._matmul(x, None), self.process_group, inplace=True)
        else:
            batch = getattr(state, "batch_size", None)
            y = reduce_scatter_sequence(self._matmul(x, None), self.process_group, batch)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        """Sizes, TP size and input mode, for ``repr``."""
        return f"{super().extra_repr()}, parallel_input={self.parallel_input}"


class _Conv1DLayout:
    """transformers' ``Conv1D`` layout: weight ``(in, out)``, with its ``nf``/``nx`` names."""

    in_features: int
    out_features: int
    _out_dim = 1

    @classmethod
    def _native_sizes(cls, module: nn.Module) -> tuple[int, int]:
        return int(_native_weight(module).shape[0]), int(_native_weight(module).shape[1])

    @property
    def nf(self) -> int:
        """Output features of the native layer (``Conv1D``'s name)."""
        return self.out_features

    @property
    def nx(self) -> int:
        """Input features of the native layer (``Conv1D``'s name)."""
        return self.in_features


class GPT2FusedLinearConv1D_Col(_Conv1DLayout, Linear1D_Col):  # noqa: N801 - ColossalAI's name
    """Column-parallel ``transformers.pytorch_utils.Conv1D`` (weight ``(in, out)``).

    ``from_native_module(conv1d, pg, n_fused=3, gather_output=False)`` for GPT-2's fused
    ``c_attn``; ``n_fused=1`` for ``c_fc``.
    """


class GPT2FusedLinearConv1D_Row(_Conv1DLayout, Linear1D_Row):  # noqa: N801 - ColossalAI's name
    """Row-parallel ``transformers.pytorch_utils.Conv1D`` (weight ``(in / tp, out)``)."""
