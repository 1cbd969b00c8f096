"""Per-rank memory and communication formulas of the block stack in each TP mode.

``P`` ranks; 2D: ``P = q^2``, 2.5D: ``P = d q^2``, 3D: ``P = q^3``. ``n = batch * seq`` rows,
``h`` hidden, ``f`` the MLP width, ``e = 4`` bytes (fp32). A block has six linear layers
(q, k, v, proj: ``h -> h``; fc1: ``h -> f``; fc2: ``f -> h``) and two LayerNorms of ``h``.

Parameters per rank (weights by the seed pages' tables, vectors by each layer's layout):

* 1D (Megatron): every weight ``/P``; column-parallel biases (q, k, v, fc1) ``/P``, the
  row-parallel ones (proj, fc2) and the LayerNorms whole (replicated).
* 2D: weights ``/q^2``; biases and LayerNorm vectors ``/q^2`` (piece ``i`` of block ``j``).
* 2.5D: weights ``/q^2`` (replicated over the depth); biases and LayerNorm vectors ``/q``.
* 3D: weights ``/q^3``; biases and LayerNorm vectors ``/q``.

Activations per rank (every tensor a block produces, see ``_tp_modes_model.RECORD``): in 2D,
2.5D and 3D every activation is split over all ``P`` ranks (rows ``q`` / ``d q`` / ``q^2``
ways, columns or heads ``q`` ways), so ``1/P`` of the whole; 1D splits the heads' q, k, v,
probabilities and context and the MLP's hidden layer ``P`` ways and keeps the block's input,
LayerNorm outputs, the row-parallel outputs and the residual sums whole.

Communication per training step (forward + backward), in the tracker's logical sizes (an
all-reduce's or broadcast's tensor, an all-gather's output, a reduce-scatter's input), from
each layer's algorithm (the layer docstrings; asserted per layer in the layer tests):

* 1D: per block 4 all-reduces of ``n h e`` (forward after proj and fc2, backward at the
  attention's and the MLP's input).
* 2D, Linear ``(in, out)``: SUMMA, ``3 n in e / q + 3 in out e / q`` (broadcasts of X and A
  forward and again backward, reduces of dX and dA) plus ``2 out e / q`` (bias all-gather and
  reduce-scatter); LayerNorm: ``4 n e / q`` (row statistics) ``+ 4 h e / q`` (affine gather
  and reduce-scatter).
* 2.5D, Linear: ``3 n in e / (d q) + 3 in out e / q`` (gathers of X and A, again backward,
  reduce-scatters of dX and dA) ``+ in out e / q^2`` (dA over the depth) ``+ out e / q``
  (bias gradient); LayerNorm: ``4 n e / (d q) + 2 h e / q``.
* 3D, Linear: ``2 n (in + out) e / q^2`` (X and Y / dY gathers and reduce-scatters)
  ``+ 2 in out e / q^2`` (A gather, dA reduce-scatter) ``+ out e / q`` (bias gradient);
  LayerNorm: ``4 n e / q^2 + 2 h e / q``.

:func:`wire_bytes` turns a tracker summary into what one rank sends with ring algorithms
(all-reduce ``2 (g-1)/g``, the others ``(g-1)/g`` of the logical size, ``g`` the group size)
and the number of ring steps (latency terms).
"""

from __future__ import annotations

from collections.abc import Mapping

from _tp_modes_model import Size

__all__ = ["activation_elems", "comm_bytes", "grid", "param_elems", "wire_bytes"]

E = 4  # bytes of a float32


def grid(mode: str, world: int) -> tuple[int, int]:
    """``(q, d)`` of ``mode`` over ``world`` ranks (1D: ``(world, 1)``)."""
    if mode == "1d":
        return world, 1
    if mode == "2d":
        q = round(world**0.5)
        return q, 1
    if mode == "2.5d":
        q = round((world // 2) ** 0.5)
        return q, 2
    return round(world ** (1 / 3)), 1


def _linears(size: Size) -> list[tuple[int, int, str]]:
    """``(in, out, kind)`` of one block's linear layers; kind: 1D column or row parallel."""
    h, f = size.hidden, size.ffn
    return [(h, h, "col")] * 3 + [(h, h, "row"), (h, f, "col"), (f, h, "row")]


def param_elems(mode: str, size: Size, world: int) -> float:
    """Parameter elements one rank holds (module docstring)."""
    q, d = grid(mode, world)
    h = size.hidden
    total = 0.0
    for fan_in, out, kind in _linears(size):
        w = fan_in * out
        if mode == "1d":
            total += w / world + (out / world if kind == "col" else out)
        elif mode == "2d":
            total += w / q**2 + out / q**2
        elif mode == "2.5d":
            total += w / q**2 + out / q
        else:
            total += w / q**3 + out / q
    norms = 2 * 2 * h  # two LayerNorms, weight and bias
    vec = {"1d": 1, "2d": q**2, "2.5d": q, "3d": q}[mode]
    return size.layers * (total + norms / vec)


def activation_elems(mode: str, size: Size, world: int) -> float:
    """Activation elements one rank holds after a forward (module docstring)."""
    n, h, f = size.batch * size.seq, size.hidden, size.ffn
    probs = size.batch * size.heads * size.seq**2
    split = 4 * n * h + probs + 2 * n * f  # q, k, v, context; probabilities; fc1, gelu
    whole = 6 * n * h  # ln1, proj, residual, ln2, fc2, residual
    if mode == "1d":
        per_block = split / world + whole
    else:
        per_block = (split + whole) / world
    return size.layers * per_block


def comm_bytes(mode: str, size: Size, world: int) -> int:
    """Logical bytes of one rank's collectives in one training step (module docstring)."""
    q, d = grid(mode, world)
    n, h = size.batch * size.seq, size.hidden
    if mode == "1d":
        return size.layers * 4 * n * h * E
    total = 0.0
    for fan_in, out, _ in _linears(size):
        w = fan_in * out
        if mode == "2d":
            total += 3 * n * fan_in / q + 3 * w / q + 2 * out / q
        elif mode == "2.5d":
            total += 3 * n * fan_in / (d * q) + 3 * w / q + w / q**2 + out / q
        else:
            total += 2 * n * (fan_in + out) / q**2 + 2 * w / q**2 + out / q
    if mode == "2d":
        norm = 4 * n / q + 4 * h / q
    elif mode == "2.5d":
        norm = 4 * n / (d * q) + 2 * h / q
    else:
        norm = 4 * n / q**2 + 2 * h / q
    return round(size.layers * (total + 2 * norm) * E)


def wire_bytes(
    summary: Mapping[str, Mapping[tuple[int, ...], tuple[int, int]]],
) -> tuple[float, int]:
    """(bytes one rank sends, ring steps) for ``{kind: {group ranks: (calls, bytes)}}``."""
    sent, steps = 0.0, 0
    for kind, groups in summary.items():
        for ranks, (calls, nbytes) in groups.items():
            g = len(ranks)
            factor = 2 if kind == "all_reduce" else 1
            sent += factor * (g - 1) / g * nbytes
            steps += factor * (g - 1) * calls
    return sent, steps
