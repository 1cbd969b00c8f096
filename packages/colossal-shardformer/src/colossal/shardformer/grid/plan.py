""":class:`GridPlan`: what a policy tells the 2D/2.5D/3D integration about a model, as data.

A grid mode splits the activation of a transformer block on the batch and the hidden dim
(2D: ``[B/q, S, H/q]``). The integration keeps everything outside the blocks (embeddings,
final norm, heads, losses) replicated and whole, splits the hidden state entering the first
block into this rank's part and gathers it after the last block; inside the blocks every
linear layer, norm and dropout becomes the mode's layer. The plan names those pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["BATCH_INPUTS", "GridPlan"]

BATCH_INPUTS = (
    "attention_mask",
    "position_ids",
    "position_embeddings",
    "encoder_attention_mask",
)
"""Block arguments that carry the batch dim (split like the activation's rows when their
dim 0 is the whole batch; a dim 0 of 1 broadcasts and stays)."""

_ROLES = ("in", "out")


@dataclass(frozen=True)
class GridPlan:
    """How a grid mode shards a model's transformer blocks.

    Attributes:
        layers: Dotted path (from the model being sharded) of the ``nn.ModuleList`` of blocks.
        linears: Suffix inside a block -> role: ``"in"`` for a layer reading the block's
            hidden state (q, k, v, the MLP's up/gate), ``"out"`` for one writing back to it
            (the attention output, the MLP's down projection). ``nn.Linear`` or ``Conv1D``.
        fused: Suffix -> number of projections fused side by side in its output (GPT-2's
            ``c_attn``: 3).
        norms: Suffixes of the hidden-state norms inside a block (``nn.LayerNorm`` or a
            Llama-style RMSNorm).
        replicated_grad: Suffixes of modules applied to split heads (per-head q/k norms): kept
            whole, their gradients summed over the grid.
        heads: Dotted attribute (inside a block) -> its whole value, divided by ``q`` (each
            rank holds ``1/q`` of the heads).
        widths: Model dimension name -> size (hidden and MLP widths), checked up front against
            the mode's width rule (:attr:`GridMode.width_parts`).
        head_counts: Config name -> head count, checked up front to divide by ``q``.
        batch_inputs: Block arguments carrying the batch dim (see :data:`BATCH_INPUTS`).
    """

    layers: str
    linears: Mapping[str, str]
    fused: Mapping[str, int] = field(default_factory=dict)
    norms: tuple[str, ...] = ()
    replicated_grad: tuple[str, ...] = ()
    heads: Mapping[str, int] = field(default_factory=dict)
    widths: Mapping[str, int] = field(default_factory=dict)
    head_counts: Mapping[str, int] = field(default_factory=dict)
    batch_inputs: tuple[str, ...] = BATCH_INPUTS

    def __post_init__(self) -> None:
        bad = {s: r for s, r in self.linears.items() if r not in _ROLES}
        if bad:
            raise ValueError(f"GridPlan.linears roles must be 'in' or 'out', got {bad}")
        unknown = sorted(set(self.fused) - set(self.linears))
        if unknown:
            raise ValueError(f"GridPlan.fused names {unknown}, which are not in linears")
