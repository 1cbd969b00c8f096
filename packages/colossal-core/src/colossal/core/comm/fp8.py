"""Collectives that move float8 instead of the tensors' own dtype (fp8 communication).

Each helper encodes its payload with an :class:`~colossal.core.comm.fp8_codec.Fp8Codec`
(float8 values plus float32 scales, as ``uint8`` bytes, so gloo carries them too), moves the
bytes through the ordinary helpers of :mod:`colossal.core.comm` and decodes on arrival.
Sums are never taken in float8: the reducing collectives exchange the pieces (an all-to-all)
and add them in float32 on the rank that owns the piece.

=====================  =============================================================  =======
helper                 what moves                                                     records
=====================  =============================================================  =======
``fp8_all_gather``     each rank's encoded input, gathered                            W x P
``fp8_reduce_scatter`` piece ``i`` of every rank's input to rank ``i`` (all-to-all),  W x P
                       summed there in float32
``fp8_all_reduce``     ``fp8_reduce_scatter`` of the tensor cut in W pieces, then     W x P
                       ``fp8_all_gather`` of the summed pieces (re-encoded)
``fp8_all_to_all``     the encoded pieces                                             W x P
``fp8_send``/``recv``  the encoded tensor                                             P
=====================  =============================================================  =======

``P`` is the encoded size of one piece: its elements (one byte each) plus four bytes per
scale. The comm tracker records one call per helper, of its logical kind (``"all_reduce"``
...), with ``dtype`` the float8 format and the bytes above: a quarter of what the same
collective records in float32 (the all-reduce's two phases each move ``(W-1)/W`` of it per
rank, as a ring all-reduce does, so its record compares with the float32 all-reduce's too),
plus the scales. Every helper is synchronous; the result on every rank is the decoded
value (also this rank's own piece of an all-gather), so replicas stay identical. With one
rank nothing is encoded.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm.fp8_codec import Fp8Codec
from colossal.core.comm.ops import all_to_all, group_ranks, recv, send
from colossal.core.comm.sharded import all_gather
from colossal.core.comm.tracker import quiet, record

__all__ = [
    "DEFAULT_CODEC",
    "fp8_all_gather",
    "fp8_all_reduce",
    "fp8_all_to_all",
    "fp8_recv",
    "fp8_reduce_scatter",
    "fp8_send",
]

DEFAULT_CODEC = Fp8Codec()
"""e4m3, one scale per piece."""

_REDUCE_OPS = (ReduceOp.SUM, ReduceOp.AVG)


def _name(codec: Fp8Codec) -> str:
    return str(codec.dtype).removeprefix("torch.")


def _check_op(op: ReduceOp.RedOpType, where: str) -> None:
    if op not in _REDUCE_OPS:
        raise ValueError(f"{where}: fp8 communication sums or averages only, got op={op}")


def _check_float(tensor: torch.Tensor, where: str) -> None:
    if not tensor.is_floating_point():
        raise TypeError(
            f"{where}: fp8 communication encodes floating-point tensors, got {tensor.dtype}; "
            "send integer tensors with the plain helper"
        )


def _encode_pieces(flat: torch.Tensor, pieces: int, codec: Fp8Codec) -> torch.Tensor:
    """``flat`` (``pieces`` equal pieces) encoded piece by piece: a (pieces, P) uint8 tensor."""
    n = flat.numel() // pieces
    out = torch.empty(pieces, codec.encoded_size(n), dtype=torch.uint8, device=flat.device)
    for i in range(pieces):
        codec.encode(flat[i * n : (i + 1) * n], out=out[i])
    return out


def _exchange_sum(
    flat: torch.Tensor,
    size: int,
    group: ProcessGroup | None,
    codec: Fp8Codec,
) -> torch.Tensor:
    """This rank's piece of the sum over ``group`` of ``flat`` (``size`` pieces), float32."""
    n = flat.numel() // size
    sent = _encode_pieces(flat, size, codec)
    got = torch.empty_like(sent)
    all_to_all(got, sent, group=group)
    total = codec.decode(got[0], n)
    for j in range(1, size):
        total.add_(codec.decode(got[j], n))
    return total


def _gather_decoded(
    piece: torch.Tensor,
    size: int,
    group: ProcessGroup | None,
    codec: Fp8Codec,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Every rank's ``piece`` (rank order), encoded, gathered and decoded: flat ``dtype``."""
    n = piece.numel()
    mine = codec.encode(piece)
    got = torch.empty(size * mine.numel(), dtype=torch.uint8, device=piece.device)
    all_gather(got, mine, group=group)
    rows = got.view(size, -1)
    return torch.cat([codec.decode(rows[j], n, dtype) for j in range(size)])


def fp8_all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Sum (or average) ``tensor`` in place across ``group``, moving float8.

    The tensor is cut into ``W`` pieces (zero-padded to a multiple of ``W``); piece ``i`` of
    every rank goes to rank ``i`` (float8), which adds them in float32, re-encodes the sum
    and all-gathers it. Each element errs by at most the codec's bound of every rank's
    contribution plus that of the sum.

    Raises:
        ValueError: an ``op`` other than SUM or AVG.
        TypeError: a tensor that is not floating point.
    """
    _check_op(op, "fp8_all_reduce")
    _check_float(tensor, "fp8_all_reduce")
    key = group_ranks(group)
    size = len(key)
    if size == 1:
        return
    flat = tensor.reshape(-1)
    numel = flat.numel()
    chunk = -(-numel // size)
    padded = torch.nn.functional.pad(flat, (0, chunk * size - numel))
    record("all_reduce", key, size * codec.encoded_size(chunk), _name(codec))
    with quiet():
        mine = _exchange_sum(padded, size, group, codec)
        if op == ReduceOp.AVG:
            mine.div_(size)
        full = _gather_decoded(mine, size, group, codec, tensor.dtype)
    with torch.no_grad():
        tensor.copy_(full[:numel].view(tensor.shape))


def fp8_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Sum (or average) the flat ``input`` across ``group``; keep this rank's slice in ``output``.

    Raises:
        ValueError: ``input`` is not ``W`` slices of ``output``'s size, or an ``op`` other
            than SUM or AVG.
        TypeError: a tensor that is not floating point.
    """
    _check_op(op, "fp8_reduce_scatter")
    _check_float(input, "fp8_reduce_scatter")
    key = group_ranks(group)
    size, n = len(key), output.numel()
    if input.numel() != n * size:
        raise ValueError(
            f"fp8_reduce_scatter: input has {input.numel()} elements but the group of {size} "
            f"ranks needs {size} x output ({n}) = {size * n}; pad the input"
        )
    flat = input.reshape(-1)
    if size == 1:
        output.view(-1).copy_(flat)
        return
    record("reduce_scatter", key, size * codec.encoded_size(n), _name(codec))
    with quiet():
        mine = _exchange_sum(flat, size, group, codec)
    if op == ReduceOp.AVG:
        mine.div_(size)
    output.view(-1).copy_(mine)


def fp8_all_gather(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    group: ProcessGroup | None = None,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Gather every rank's equal-size ``input`` into the flat ``output`` (rank order), as float8.

    Every slot of ``output``, this rank's own included, holds the decoded value.

    Raises:
        ValueError: ``output`` does not hold ``W`` copies of ``input``'s size.
        TypeError: a tensor that is not floating point.
    """
    _check_float(input, "fp8_all_gather")
    key = group_ranks(group)
    size, n = len(key), input.numel()
    if output.numel() != n * size:
        raise ValueError(
            f"fp8_all_gather: output has {output.numel()} elements but the group of {size} "
            f"ranks gathers {size} x input ({n}) = {size * n}; pad the inputs to equal size"
        )
    piece = input.reshape(-1).clone()  # input may be a view into output
    if size == 1:
        output.view(-1).copy_(piece)
        return
    record("all_gather", key, size * codec.encoded_size(n), _name(codec))
    with quiet():
        full = _gather_decoded(piece, size, group, codec, output.dtype)
    output.view(-1).copy_(full)


def fp8_all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 - torch's own name
    group: ProcessGroup | None = None,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Send equal slice ``i`` of the flat ``input`` to rank ``i``; gather theirs into ``output``.

    Each slice is encoded with its own scales.

    Raises:
        ValueError: ``input`` and ``output`` differ in size or are not ``W`` equal slices.
        TypeError: a tensor that is not floating point.
    """
    _check_float(input, "fp8_all_to_all")
    key = group_ranks(group)
    size = len(key)
    if input.numel() != output.numel() or input.numel() % size:
        raise ValueError(
            f"fp8_all_to_all: input ({input.numel()}) and output ({output.numel()}) must have "
            f"the same number of elements, a multiple of the group size {size} (equal splits)"
        )
    flat = input.reshape(-1)
    if size == 1:
        output.view(-1).copy_(flat)
        return
    n = flat.numel() // size
    record("all_to_all", key, size * codec.encoded_size(n), _name(codec))
    sent = _encode_pieces(flat, size, codec)
    got = torch.empty_like(sent)
    with quiet():
        all_to_all(got, sent, group=group)
    out = output.view(-1)
    for j in range(size):
        out[j * n : (j + 1) * n] = codec.decode(got[j], n, output.dtype)


def fp8_send(
    tensor: torch.Tensor,
    dst: int,
    group: ProcessGroup | None = None,
    tag: int = 0,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Send ``tensor`` encoded as float8 to global rank ``dst`` (blocking).

    Raises:
        TypeError: a tensor that is not floating point.
    """
    _check_float(tensor, "fp8_send")
    encoded = codec.encode(tensor)
    record("send", group_ranks(group), encoded.numel(), _name(codec))
    with quiet():
        send(encoded, dst, group=group, tag=tag)


def fp8_recv(
    tensor: torch.Tensor,
    src: int,
    group: ProcessGroup | None = None,
    tag: int = 0,
    codec: Fp8Codec = DEFAULT_CODEC,
) -> None:
    """Receive into ``tensor`` what :func:`fp8_send` sent from global rank ``src`` (blocking).

    Raises:
        TypeError: a tensor that is not floating point.
    """
    _check_float(tensor, "fp8_recv")
    n = tensor.numel()
    encoded = torch.empty(codec.encoded_size(n), dtype=torch.uint8, device=tensor.device)
    record("recv", group_ranks(group), encoded.numel(), _name(codec))
    with quiet():
        recv(encoded, src, group=group, tag=tag)
    with torch.no_grad():
        tensor.copy_(codec.decode(encoded, n, tensor.dtype).view(tensor.shape))
