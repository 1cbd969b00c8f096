"""Grid-mode layers the mode subpackages do not have: RMSNorm and GPT-2's ``Conv1D``.

* :class:`GridRootMeanSquareNorm`: Llama-style RMSNorm of a hidden state split over ``q``
  ranks (one all-reduce of the row sums of squares over the hidden axis forward and backward).
  Its weight is this rank's block of the hidden dim, replicated along the batch axes (its
  gradient summed over them): ``1/q`` of the weight, a small price for a vector. (Named so
  that the fused-norm swap, which matches ``*RMSNorm`` class names, leaves it alone.)
* :class:`GridConv1D`: a ``Conv1D`` (weight ``[in, out]``) running the mode's linear op. The
  parameters stay in ``Conv1D``'s layout and are marked as parts of the whole ``[in, out]``
  tensor, so checkpoints are Hugging Face's. A fused projection (GPT-2's ``c_attn``: q, k, v
  side by side) is reordered so that every output block of the grid holds its slice of each
  segment (``[q_j, k_j, v_j]``), which the attention's ``split(split_size)`` then separates;
  the marks describe that as :class:`~colossal.core.Blocks` of the original layout.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from colossal.core import Block, Blocks, Placement, Replicate, mark_sharded, shard_spec
from colossal.core.comm import all_reduce
from colossal.shardformer.grid.modes import GridMode

__all__ = ["GridConv1D", "GridRootMeanSquareNorm", "fused_order", "is_rms_norm"]


class _SumForwardBackward(torch.autograd.Function):
    """All-reduce forward; all-reduce of the gradient backward (every rank uses the sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.contiguous().clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        all_reduce(out, group=ctx.group)
        return out, None


class _SumGrad(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a copy used on this rank's rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        all_reduce(out, group=ctx.group)
        return out, None


def is_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-style RMSNorm (``weight * x / rms(x)``, eps attribute)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and hasattr(module, "variance_epsilon")
    )


class GridRootMeanSquareNorm(nn.Module):
    """Llama's RMSNorm over a hidden dim split along the mode's hidden axis.

    Forward on ``x`` ``(b, ..., H/q)``: the sums of squares of this rank's columns, one
    all-reduce over the hidden axis, ``x * rsqrt(sum / H + eps)`` in fp32, times this rank's
    block of the weight. Seeding: none (no randomness).

    Args:
        native: The RMSNorm to shard (its ``weight`` ``(H,)`` and ``variance_epsilon``).
        mode: The grid mode.

    Raises:
        TypeError: ``native`` is not a Llama-style RMSNorm.
        ValueError: ``H`` is not divisible by ``q``.
    """

    weight: nn.Parameter

    def __init__(self, native: nn.Module, mode: GridMode) -> None:
        super().__init__()
        if not is_rms_norm(native):
            raise TypeError(
                "GridRootMeanSquareNorm shards Llama-style RMSNorms (weight and "
                f"variance_epsilon), got {type(native).__name__}"
            )
        whole = cast(torch.Tensor, native.weight)
        width = int(whole.shape[0])
        q = mode.q
        if width % q:
            raise ValueError(
                f"{type(native).__name__}: hidden size {width} is not divisible by q={q} for "
                f"tensor_parallel_mode={mode.name!r} ({mode.describe()})"
            )
        dims = mode.dims
        j = dims.coordinate(mode.hidden_axis)
        step = width // q
        block = Block.along((width,), 0, j * step, (j + 1) * step)
        placements = [Placement(mode.hidden_axis, block, dims.group(mode.hidden_axis))]
        placements += [Placement(a, Replicate(), dims.group(a)) for a in mode.batch_axes]
        param = nn.Parameter(
            block.take(whole.detach()).clone().contiguous(), requires_grad=whole.requires_grad
        )
        self.weight = mark_sharded(param, placements, (width,))  # type: ignore[assignment]
        self.width = width
        self.variance_epsilon = float(cast(float, native.variance_epsilon))
        self.hidden_group = dims.group(mode.hidden_axis)
        self.batch_group = dims.group(mode.batch_axes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize this rank's part ``(b, ..., H/q)`` over the whole width ``H``."""
        dtype = x.dtype
        h = x.to(torch.float32)
        total = _SumForwardBackward.apply(h.pow(2).sum(-1, keepdim=True), self.hidden_group)
        h = h * torch.rsqrt(total / self.width + self.variance_epsilon)
        return _SumGrad.apply(self.weight, self.batch_group) * h.to(dtype)

    def extra_repr(self) -> str:
        """Width and eps, for ``repr``."""
        return f"({self.width},), eps={self.variance_epsilon}, local={tuple(self.weight.shape)}"


def fused_order(out: int, n_fused: int, q: int) -> torch.Tensor:
    """Output indices reordered so block ``c`` of ``q`` holds segment block ``c`` of each segment.

    ``[q | k | v]`` (``n_fused = 3``) becomes ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``.
    """
    seg = out // n_fused
    per = seg // q
    idx = torch.arange(out).view(n_fused, q, per).transpose(0, 1)
    return idx.reshape(-1)


def _fuse_level(part: Block, above: tuple[int, ...], dim: int, n_fused: int) -> Blocks:
    """A block of the reordered tensor's ``dim`` as the blocks of the original it holds."""
    seg = above[dim] // n_fused
    size = part.sizes[dim]
    parts = above[dim] // size
    per = seg // parts
    c = part.offsets[dim] // size
    blocks = []
    for f in range(n_fused):
        offsets = list(part.offsets)
        sizes = list(part.sizes)
        offsets[dim], sizes[dim] = f * seg + c * per, per
        blocks.append(Block(tuple(offsets), tuple(sizes)))
    return Blocks(dim, tuple(blocks))


def _transpose_part(part: Any) -> Any:
    if isinstance(part, Block):
        return Block(part.offsets[::-1], part.sizes[::-1])
    if isinstance(part, Blocks):
        return Blocks(1 - part.dim, tuple(_transpose_part(b) for b in part.blocks))
    return part


def _original_placements(
    tensor: torch.Tensor, out_dim: int, n_fused: int, transpose: bool
) -> tuple[list[Placement], tuple[int, ...]]:
    """``tensor``'s placements (of the reordered ``[out, ...]`` whole) as parts of the original.

    The first level that splits ``out_dim`` cuts the reordered tensor into blocks of
    ``[seg_0 seg_1 ...]`` slices, i.e. :class:`Blocks` of the original; deeper levels are
    relative to the held block, the same in both. ``transpose`` swaps the two dims of a 2-D
    tensor (``nn.Linear``'s ``[out, in]`` to ``Conv1D``'s ``[in, out]``).
    """
    spec = shard_spec(tensor)
    assert spec is not None, "the mode's layer marks its parameters"
    above = tuple(int(s) for s in spec.shape)
    done = n_fused == 1  # the fused level is found (or there is none)
    out: list[Placement] = []
    for p in spec.placements:
        part = p.part
        if isinstance(part, Block):
            if not done and part.sizes[out_dim] < above[out_dim]:
                part, done = _fuse_level(part, above, out_dim, n_fused), True
            above = tuple(part.sizes) if isinstance(part, Block) else _held(part)
        if transpose:
            part = _transpose_part(part)
        out.append(Placement(p.axis, part, p.group))
    shape = tuple(int(s) for s in spec.shape)
    return out, (shape[::-1] if transpose else shape)


def _held(part: Blocks) -> tuple[int, ...]:
    sizes = list(part.blocks[0].sizes)
    sizes[part.dim] = sum(b.sizes[part.dim] for b in part.blocks)
    return tuple(sizes)


class GridConv1D(nn.Module):
    """A Hugging Face ``Conv1D`` (``y = x @ weight + bias``, weight ``[in, out]``) in a grid mode.

    Args:
        native: The ``Conv1D`` (``weight`` ``[in, out]``, ``bias`` ``[out]``).
        mode: The grid mode.
        role: ``"in"`` or ``"out"`` (see :mod:`.modes`).
        n_fused: Projections fused side by side in the output (3 for GPT-2's ``c_attn``).

    Raises:
        ValueError: The widths do not divide the grid.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, native: nn.Module, mode: GridMode, role: str, n_fused: int = 1) -> None:
        super().__init__()
        whole = cast(torch.Tensor, native.weight).detach()
        in_features, out_features = (int(s) for s in whole.shape)
        if out_features % (n_fused * mode.q):
            raise ValueError(
                f"{type(native).__name__}: out_features={out_features} does not split into "
                f"{n_fused} fused parts of q={mode.q} blocks each for tensor_parallel_mode="
                f"{mode.name!r} ({mode.describe()})"
            )
        order = fused_order(out_features, n_fused, mode.q)
        bias = getattr(native, "bias", None)
        linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
        linear.weight = nn.Parameter(whole.t()[order].contiguous())
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach()[order].contiguous())
        layer = mode.linear(linear, role)
        self._fn = mode.linear_fn(layer)
        self.in_features, self.out_features, self.n_fused = in_features, out_features, n_fused
        layer_weight = cast(torch.Tensor, layer.weight)
        layer_bias = cast("torch.Tensor | None", layer.bias)
        placements, shape = _original_placements(layer_weight, 0, n_fused, transpose=True)
        weight = nn.Parameter(layer_weight.detach().t().contiguous())
        self.weight = mark_sharded(weight, placements, shape)  # type: ignore[assignment]
        if layer_bias is None:
            self.register_parameter("bias", None)
        else:
            placements, shape = _original_placements(layer_bias, 0, n_fused, transpose=False)
            self.bias = mark_sharded(  # type: ignore[assignment]
                nn.Parameter(layer_bias.detach().clone()), placements, shape
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x @ weight + bias`` (the mode's layout)."""
        return self._fn(x, self.weight.t().contiguous(), self.bias)

    def extra_repr(self) -> str:
        """Sizes and fusion, for ``repr``."""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"n_fused={self.n_fused}, local_weight={tuple(self.weight.shape)}"
        )
