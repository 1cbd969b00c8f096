"""The transformer block stack of ``tensor_parallel_modes.py`` and its copy in each TP mode.

A block is pre-norm attention plus an MLP over activations ``(batch, seq, hidden)``::

    x = x + proj(attention(q(ln1(x)), k(ln1(x)), v(ln1(x))))
    x = x + fc2(gelu(fc1(ln2(x))))

with separate q/k/v projections, so in every mode a rank's columns of q, k and v are the same
whole heads and softmax attention over the (whole) sequence runs locally on them: 1D splits
the heads over the ranks, 2D / 2.5D / 3D split the batch (rows, dim 0) and the heads (columns).
:func:`shard` replaces every ``nn.Linear`` / ``nn.LayerNorm`` of a deep copy by the mode's
layer (``from_native_module``: same attribute names, same forward code, same state-dict keys).

:data:`RECORD` collects, while it is a list, every activation the block produces on this rank
(module outputs, attention probabilities and context, the GELU and the residual sums): the
"activation memory" of the seed pages' cost tables.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core import ParallelDims

__all__ = [
    "MODES",
    "RECORD",
    "ActivationRecord",
    "Size",
    "Stack",
    "gather_output",
    "mode_dims",
    "shard",
    "split_input",
]

#: (mode, world size) in the order the benchmark runs them; 1D is the reference at each world.
MODES: tuple[tuple[str, int], ...] = (("1d", 4), ("2d", 4), ("1d", 8), ("2.5d", 8), ("3d", 8))


@dataclass(frozen=True)
class Size:
    """Sizes of the stack and its batch."""

    hidden: int
    heads: int
    layers: int
    batch: int
    seq: int
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.mlp_ratio * self.hidden


class ActivationRecord:
    """Activations recorded during one forward (name, this rank's tensor's element count)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int]] = []
        self.active = False

    def add(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Record ``t`` under ``name`` when active; returns ``t``."""
        if self.active:
            self.items.append((name, t.numel()))
        return t

    def __enter__(self) -> ActivationRecord:
        self.items.clear()
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False


RECORD = ActivationRecord()


class Attention(nn.Module):
    """Softmax attention with separate q/k/v projections over the heads a rank holds."""

    def __init__(self, hidden: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, width)`` -> the same layout (heads = the columns this rank holds)."""
        q, k, v = (RECORD.add(n, m(x)) for n, m in (("q", self.q), ("k", self.k), ("v", self.v)))
        b, s, width = q.shape
        heads = width // self.head_dim

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, s, heads, self.head_dim).transpose(1, 2)

        scores = split(q) @ split(k).transpose(-1, -2) * self.head_dim**-0.5
        probs = RECORD.add("probs", scores.softmax(-1))
        ctx = RECORD.add("context", (probs @ split(v)).transpose(1, 2).reshape(b, s, width))
        return RECORD.add("proj", self.proj(ctx))


class Mlp(nn.Module):
    """``fc2(gelu(fc1(x)))``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, hidden)`` -> ``(b, s, hidden)`` in the input's layout."""
        h = RECORD.add("gelu", F.gelu(RECORD.add("fc1", self.fc1(x))))
        return RECORD.add("fc2", self.fc2(h))


class Block(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(size.hidden), nn.LayerNorm(size.hidden)
        self.attn = Attention(size.hidden, size.head_dim)
        self.mlp = Mlp(size.hidden, size.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        x = RECORD.add("residual", x + self.attn(RECORD.add("ln1", self.ln1(x))))
        return RECORD.add("residual", x + self.mlp(RECORD.add("ln2", self.ln2(x))))


class Stack(nn.Module):
    """``size.layers`` blocks (the plain single-process model every mode starts from)."""

    def __init__(self, size: Size, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, s, hidden)`` (this rank's part in a parallel copy) -> the same layout."""
        for block in self.blocks:
            x = block(x)
        return x


def mode_dims(mode: str, world: int) -> ParallelDims:
    """The layout of ``mode`` over all ``world`` ranks (2.5D: depth 2)."""
    if mode == "1d":
        return ParallelDims(tp=world, world_size=world)
    depth = 2 if mode == "2.5d" else 1
    return ParallelDims(tp=world, tp_mode=mode, tp_depth=depth, world_size=world)


def _shard_1d(model: Stack, dims: ParallelDims) -> None:
    from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row, enter_tp_region

    group = dims.group("tp")
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        for name in ("q", "k", "v"):
            setattr(attn, name, Linear1D_Col.from_native_module(getattr(attn, name), group))
        attn.proj = Linear1D_Row.from_native_module(attn.proj, group)
        mlp.fc1 = Linear1D_Col.from_native_module(mlp.fc1, group)
        mlp.fc2 = Linear1D_Row.from_native_module(mlp.fc2, group)
        # Megatron's f once per attention / MLP input (one backward all-reduce each)
        enter_tp_region(attn, group)
        enter_tp_region(mlp, group)


def _shard_grid(model: Stack, dims: ParallelDims, mode: str) -> None:
    from colossal.shardformer import layer as L  # noqa: N812 - short module alias

    linear, norm = {
        "2d": (L.Linear2D, L.LayerNorm2D),
        "2.5d": (L.Linear2p5D, L.LayerNorm2p5D),
    }[mode]
    for block in model.blocks:
        block.ln1 = norm.from_native_module(block.ln1, dims)
        block.ln2 = norm.from_native_module(block.ln2, dims)
        for parent, names in ((block.attn, ("q", "k", "v", "proj")), (block.mlp, ("fc1", "fc2"))):
            for name in names:
                setattr(parent, name, linear.from_native_module(getattr(parent, name), dims))


def _shard_3d(model: Stack, dims: ParallelDims) -> None:
    from colossal.shardformer.layer import LayerNorm3D, Linear3D

    for block in model.blocks:
        # The block's input and output keep the unswapped orientation; each Linear3D flips it,
        # so q/k/v (and fc1) give swapped outputs and proj (and fc2) flip them back.
        block.ln1 = LayerNorm3D.from_native_module(block.ln1, dims)
        block.ln2 = LayerNorm3D.from_native_module(block.ln2, dims)
        attn, mlp = block.attn, block.mlp
        for name in ("q", "k", "v"):
            setattr(attn, name, Linear3D.from_native_module(getattr(attn, name), dims))
        attn.proj = Linear3D.from_native_module(attn.proj, dims, swapped=attn.q.output_swapped)
        mlp.fc1 = Linear3D.from_native_module(mlp.fc1, dims)
        mlp.fc2 = Linear3D.from_native_module(mlp.fc2, dims, swapped=mlp.fc1.output_swapped)


def shard(plain: Stack, mode: str, dims: ParallelDims) -> Stack:
    """A deep copy of ``plain`` built from ``mode``'s layers (``"1d"``, ``"2d"``, ``"2.5d"``,
    ``"3d"``), holding this rank's parts of the same values."""
    model = copy.deepcopy(plain)
    if mode == "1d":
        _shard_1d(model, dims)
    elif mode == "3d":
        _shard_3d(model, dims)
    else:
        _shard_grid(model, dims, mode)
    return model


def split_input(x: torch.Tensor, mode: str, dims: ParallelDims) -> torch.Tensor:
    """This rank's part of a whole activation (1D: the whole, replicated)."""
    from colossal.shardformer import layer as L  # noqa: N812 - short module alias

    split = {"2d": L.split_input_2d, "2.5d": L.split_input_2p5d, "3d": L.split_input_3d}
    return x if mode == "1d" else split[mode](x, dims)


def gather_output(y: torch.Tensor, mode: str, dims: ParallelDims) -> torch.Tensor:
    """The whole activation from every rank's part (collective; 1D: ``y`` itself)."""
    from colossal.shardformer import layer as L  # noqa: N812 - short module alias

    gather = {"2d": L.gather_output_2d, "2.5d": L.gather_output_2p5d, "3d": L.gather_output_3d}
    return y if mode == "1d" else gather[mode](y, dims)
