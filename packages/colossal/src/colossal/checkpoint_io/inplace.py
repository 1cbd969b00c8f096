"""Save sharded state where it lies: every rank writes its own bytes into the shared files.

A rank that holds a :class:`colossal.core.FlatRange` of a tensor (Gemini's chunk shards,
ZeRO's flat partitions) holds a contiguous byte range of that tensor's data in a safetensors
file. A save therefore needs no gather at all:

1. Every rank lays out the same files from names, shapes and dtypes (:func:`file_layout`, the
   order of a streamed save: by decreasing element size, then the plan's order).
2. Rank 0 creates each file under a hidden temporary name (``.<file>.<token>.tmp``, which the
   commit of the next save removes if this one dies), writes its header and sets its full
   size (:func:`create_files`); one object all-gather shares the token (and any error), or
   the caller's own agreement does (the sharded saver's plan carries it).
3. Every rank writes (``os.pwrite``) each part it holds at its offset (CPU tensors from
   memory, device tensors copied to the CPU :data:`PIECE_BYTES` at a time), starting each
   piece's writeback at once and computing its CRC-32, and fsyncs its files at the end. A
   tensor every rank holds whole (a buffer, a step count) is written by one rank, chosen by
   the caller's spreading rule (the same on every rank).
4. ONE object all-gather collects every rank's pieces ``(file, offset, length, crc)``. Rank 0
   checks that they tile each file exactly (:func:`check_tiling`), combines their CRC-32s in
   offset order (:func:`crc32_combine`), renames the files to their final names, fsyncs the
   directory and commits the index (:func:`colossal.checkpoint_io.commit.commit_index`). A
   last all-gather tells every rank whether the commit succeeded.

The files are byte-identical to those of a streamed save of the same tensors. Until the
commit the previous checkpoint's index and files are untouched: a save killed at any point
leaves it loadable, and only temporary files behind. A save that fails (and is not killed)
removes what it created: its temporary files, the files it renamed before the commit, and
(:func:`remove_created`, by the caller) the directories it created for them.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from colossal.checkpoint_io import durable
from colossal.checkpoint_io.checksum import crc32, crc32_combine
from colossal.checkpoint_io.commit import commit_index, referenced_files
from colossal.checkpoint_io.index import CheckpointError
from colossal.checkpoint_io.sharded import TensorLike
from colossal.core import Block, FlatRange
from colossal.core.comm import all_gather_object
from colossal.core.io import TensorInfo, tensor_memoryview
from colossal.core.io.safetensors_format import encode_header

logger = logging.getLogger(__name__)

__all__ = [
    "Piece",
    "check_tiling",
    "combine_pieces",
    "create_files",
    "crc32_combine",
    "file_layout",
    "layout_files",
    "local_part",
    "missing_root",
    "remove_created",
    "save_in_place",
    "stream_order",
    "supports_in_place",
]

PIECE_BYTES = 8 * 1024 * 1024
"""A device tensor's part is copied to the CPU and written this many bytes at a time."""
WRITEBACK_MIN_BYTES = 1024 * 1024
"""Pieces at least this long start their writeback when written; shorter ones (a step count,
a bias) are left to the final ``fsync``, as neighbours in one page would each write it."""

# ---- layout ---------------------------------------------------------------------------------
def stream_order(tensors: Mapping[str, TensorLike], names: Sequence[str]) -> list[str]:
    """``names`` in file order: by decreasing element size, then in the given order."""
    order = sorted(range(len(names)), key=lambda i: (-tensors[names[i]].dtype.itemsize, i))
    return [names[i] for i in order]


def file_layout(
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
) -> tuple[bytes, list[TensorInfo]]:
    """The header bytes (length prefix included) and the infos of ``(name, shape, dtype)``.

    The tensors follow each other in the given order, without gaps.
    """
    infos, offset = [], 0
    for name, shape, dtype in entries:
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        infos.append(TensorInfo(name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    return encode_header(infos, {"format": "pt"}), infos


# ---- local parts ----------------------------------------------------------------------------
def local_part(value: TensorLike) -> tuple[FlatRange, torch.Tensor, bool] | None:
    """``(part, its elements 1-D, replicated)`` of a value, None when it cannot be written so.

    A ``torch.Tensor`` (or a sharded tensor whose part is the whole tensor as a ``Block``) is
    held whole by every rank (``replicated``); a sharded tensor whose ``part`` is a
    :class:`FlatRange` gives that range of its flattened elements.
    """
    if isinstance(value, torch.Tensor):
        return FlatRange(0, value.numel()), value.detach().reshape(-1), True
    part = getattr(value, "part", None)
    if isinstance(part, Block) and part.is_whole(value.shape):
        local = value.local().detach()
        return FlatRange(0, local.numel()), local.reshape(-1), True
    if isinstance(part, FlatRange):
        return part, part.real(value.local().detach()) if part.numel else _EMPTY, False
    return None


_EMPTY = torch.empty(0)


def supports_in_place(tensors: Mapping[str, TensorLike]) -> bool:
    """Whether every value is a tensor, a whole ``Block`` part or a ``FlatRange`` part."""
    for value in tensors.values():
        part = value if isinstance(value, torch.Tensor) else getattr(value, "part", None)
        if not isinstance(part, torch.Tensor | FlatRange) and not (
            isinstance(part, Block) and part.is_whole(value.shape)
        ):
            return False
    return True


# ---- pieces ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of ``file`` written by one rank, with their CRC-32."""

    file: str
    offset: int
    length: int
    crc32: int


def check_tiling(pieces: Sequence[Piece], sizes: Mapping[str, int]) -> None:
    """Raise unless the pieces of each file cover its ``sizes[file]`` bytes exactly once.

    Raises:
        CheckpointError: A gap, an overlap, bytes past the end, or a piece of an unknown file
            (named, with the byte range).
    """
    by_file: dict[str, list[Piece]] = {f: [] for f in sizes}
    for piece in pieces:
        if piece.file not in by_file:
            raise CheckpointError(f"a rank wrote {piece} of {piece.file!r}, not a planned file")
        by_file[piece.file].append(piece)
    for file, size in sizes.items():
        at = 0
        for piece in sorted(by_file[file], key=lambda p: p.offset):
            if piece.offset > at:
                raise CheckpointError(
                    f"{file}: bytes [{at}, {piece.offset}) were written by no rank (a gap); "
                    "a rank's part of a tensor is missing from the save"
                )
            if piece.offset < at:
                raise CheckpointError(
                    f"{file}: bytes [{piece.offset}, {at}) were written twice (an overlap); "
                    "two ranks claim the same elements of a tensor"
                )
            at = piece.offset + piece.length
        if at != size:
            raise CheckpointError(
                f"{file}: bytes [{min(at, size)}, {max(at, size)}) "
                + ("were written by no rank (a gap at the end)" if at < size
                   else "lie past the end of the file")
            )


def combine_pieces(pieces: Sequence[Piece]) -> str:
    """The CRC-32 (8 hex digits) of a file tiled by ``pieces`` (any order)."""
    crc = 0
    for piece in sorted(pieces, key=lambda p: p.offset):
        crc = crc32_combine(crc, piece.crc32, piece.length)
    return f"{crc:08x}"


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _write_part(fd: int, data: torch.Tensor, offset: int) -> list[tuple[int, int]]:
    """Write ``data`` (1-D) at ``offset`` in pieces of at most :data:`PIECE_BYTES`.

    Each long piece's writeback starts at once (see :data:`WRITEBACK_MIN_BYTES`) and each
    piece's CRC-32 is computed here, between the writes (with zlib-ng a few ms per rank and
    save; a checksum thread cost more in hand-offs than it saved: see the CHANGELOG).
    Returns each piece's byte length and CRC-32, in order.
    """
    crcs, step = [], max(1, PIECE_BYTES // max(1, data.element_size()))
    for begin in range(0, data.numel(), step):
        piece = data[begin : begin + step]
        if piece.device.type != "cpu" or not piece.is_contiguous():
            piece = piece.to("cpu").contiguous()
        view = tensor_memoryview(piece)
        _pwrite_all(fd, view, offset)
        if len(view) >= WRITEBACK_MIN_BYTES:
            durable.start_writeback(fd, offset, len(view))
        offset += len(view)
        crcs.append((len(view), crc32(view)))
        del view
    return crcs


# ---- the save -------------------------------------------------------------------------------
def _temp_name(file: str, token: str) -> str:
    return f".{file[:200]}.{token}.tmp"


def _create(path: str, layouts: Mapping[str, tuple[bytes, int]], token: str) -> None:
    for file, (header, size) in layouts.items():
        with open(os.path.join(path, _temp_name(file, token)), "wb") as handle:
            handle.write(header)
            handle.truncate(size)


def _remove_temps(path: str, files: Sequence[str], token: str) -> None:
    for file in files:
        try:
            os.remove(os.path.join(path, _temp_name(file, token)))
        except FileNotFoundError:
            pass


def _rename(source: str, target: str) -> None:
    """Give a written file its final name (atomic; the caller fsyncs the directory once)."""
    os.replace(source, target)


def missing_root(path: str) -> str | None:
    """The outermost of ``path`` and its parents that does not exist (None: ``path`` exists).

    Taken before a save creates ``path``: what :func:`remove_created` may remove again.
    """
    path, root = os.path.abspath(path), None
    while not os.path.lexists(path):
        root, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return root


def remove_created(path: str, root: str | None) -> None:
    """After a failed save: remove ``path`` and its parents up to ``root`` while empty.

    ``root`` is :func:`missing_root` of ``path`` before the save created it; a directory
    that existed before (None) or holds anything else is kept.
    """
    path = os.path.abspath(path)
    if root is None or not (path == root or path.startswith(root.rstrip(os.sep) + os.sep)):
        return
    while True:
        try:
            os.rmdir(path)
        except OSError:  # not empty (or gone): keep it and its parents
            return
        if path == root:
            return
        path = os.path.dirname(path)


def _agree(value: Any, group: dist.ProcessGroup | None, world: int) -> list[Any]:
    return all_gather_object(value, group) if world > 1 else [value]


def _write_own(
    path: str,
    tensors: Mapping[str, TensorLike],
    plan: Sequence[tuple[str, int, list[TensorInfo]]],
    token: str,
    writers: Mapping[str, int],
    rank: int,
    world: int = 1,
) -> list[Piece]:
    """Write this rank's parts into the temporary files, fsync; the pieces (coalesced).

    Each rank starts on another file (the plan rotated by ``rank``): writers to one file share
    its inode lock, writers to different files do not.
    """
    written: list[tuple[str, int, int, list[tuple[int, int]]]] = []
    start = rank * len(plan) // max(world, 1)
    opened: list[int] = []
    try:
        for file, data_start, infos in [*plan[start:], *plan[:start]]:
            fd = None
            for info in infos:
                found = local_part(tensors[info.name])
                if found is None:
                    raise CheckpointError(
                        f"{info.name!r} is not a tensor or a FlatRange part")
                part, data, replicated = found
                if part.numel == 0 or (replicated and writers[info.name] != rank):
                    continue
                if data.dtype != info.dtype or data.numel() != part.numel:
                    raise CheckpointError(
                        f"{info.name!r}: this rank's part {part} has {data.numel()} "
                        f"elements of {data.dtype}, the checkpoint declares {info.dtype}; "
                        "a sharded tensor whose local() disagrees with its dtype or part"
                    )
                part.check(info.shape)
                if fd is None:
                    fd = _open_created(path, _temp_name(file, token), rank)
                    opened.append(fd)
                offset = data_start + info.begin + part.start * info.dtype.itemsize
                crcs = _write_part(fd, data, offset)
                written.append((file, offset, part.numel * info.dtype.itemsize, crcs))
        if not opened and plan:  # nothing to write here: still fail unless the files are seen
            os.close(_open_created(path, _temp_name(plan[0][0], token), rank))
        for fd in opened:  # the writeback of each piece started when it was written
            os.fsync(fd)
        return _coalesce(written)
    finally:
        for fd in opened:
            os.close(fd)


def _open_created(path: str, name: str, rank: int) -> int:
    """Open a file rank 0 created for writing; a clear error when this rank cannot see it."""
    try:
        return os.open(os.path.join(path, name), os.O_WRONLY)
    except FileNotFoundError as err:
        raise CheckpointError(
            f"rank {rank} does not see {os.path.join(path, name)!r}, which rank 0 created: a "
            "checkpoint saved by several ranks needs a path on a filesystem shared by all of "
            "them (e.g. NFS or Lustre); pass such a path"
        ) from err


def _coalesce(written: Sequence[tuple[str, int, int, Sequence[tuple[int, int]]]]) -> list[Piece]:
    """Pieces ``(file, offset, length, crc)`` of the written parts, adjacent ones merged.

    ``written`` holds per part its file, offset, length and the (length, CRC-32) of each
    piece it was written in.
    """
    pieces: list[Piece] = []
    for file, offset, length, crcs in written:
        crc = 0
        for size, piece_crc in crcs:
            crc = crc32_combine(crc, piece_crc, size)
        last = pieces[-1] if pieces else None
        if last is not None and last.file == file and last.offset + last.length == offset:
            pieces[-1] = Piece(file, last.offset, last.length + length,
                               crc32_combine(last.crc32, crc, length))
        else:
            pieces.append(Piece(file, offset, length, crc))
    return pieces


def layout_files(
    tensors: Mapping[str, TensorLike], files: Sequence[str], shards: Sequence[Sequence[str]]
) -> tuple[list[tuple[str, int, list[TensorInfo]]], dict[str, tuple[bytes, int]]]:
    """The plan ``(file, data start, infos)`` and the layout ``file -> (header, size)``.

    The same on every rank: it depends only on names, shapes and dtypes.
    """
    plan: list[tuple[str, int, list[TensorInfo]]] = []
    layouts: dict[str, tuple[bytes, int]] = {}
    for file, names in zip(files, shards, strict=True):
        ordered = stream_order(tensors, list(names))
        header, infos = file_layout([(n, tensors[n].shape, tensors[n].dtype) for n in ordered])
        plan.append((file, len(header), infos))
        layouts[file] = (header, len(header) + (infos[-1].end if infos else 0))
    return plan, layouts


def create_files(
    path: str,
    tensors: Mapping[str, TensorLike],
    files: Sequence[str],
    shards: Sequence[Sequence[str]],
) -> str:
    """Rank 0's first step: create the temporary files at full size; returns their token.

    Pass the token to every rank's :func:`save_in_place`. A caller that already shares an
    object from rank 0 with the group (e.g. its plan) runs this there and saves an agreement.

    Raises:
        OSError: A file could not be created (the others are removed again).
    """
    token = uuid.uuid4().hex[:12]
    _, layouts = layout_files(tensors, files, shards)
    try:
        _create(path, layouts, token)
    except OSError:
        _remove_temps(path, files, token)
        raise
    return token


def save_in_place(
    tensors: Mapping[str, TensorLike],
    path: str,
    files: Sequence[str],
    shards: Sequence[Sequence[str]],
    index: dict[str, Any] | None,
    index_name: str,
    prefix: str,
    texts: Mapping[str, str] | None,
    assign: Callable[[list[int], int], list[int]],
    group: dist.ProcessGroup | None = None,
    token: str | None = None,
) -> None:
    """Write ``shards`` (names per file) into ``files`` in ``path`` in place and commit.

    Collective over ``group``. ``path`` is prepared (no staging folder, ``files`` not
    referenced by the committed index) as :class:`colossal.checkpoint_io.saver.ShardedSaver`
    does; ``index`` is the new index without ``metadata.files``, which this fills in.
    ``assign(sizes, world)`` picks the writing rank of each replicated tensor (the same
    answer on every rank). With ``index=None`` (a lone file) the files are only renamed into
    place: there is no index to commit. ``token``: rank 0 already created the files with
    :func:`create_files` and every rank got its token; without it rank 0 creates them here.
    A rank that cannot see a file rank 0 created (``path`` not on a filesystem shared by the
    group) fails the save on every rank.

    Raises:
        CheckpointError: On every rank, when a rank failed or the pieces do not tile the files.
        OSError: On every rank, when rank 0 could not create or commit the files.
    """
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) \
        if dist.is_initialized() else (0, 1)
    plan, layouts = layout_files(tensors, files, shards)
    replicated = [n for names in shards for n in names
                  if isinstance(tensors[n], torch.Tensor) or not isinstance(
                      getattr(tensors[n], "part", None), FlatRange)]
    sizes = [math.prod(tensors[n].shape) * tensors[n].dtype.itemsize for n in replicated]
    writers = dict(zip(replicated, assign(sizes, world), strict=True))

    # 1. rank 0 creates the files at full size; everyone learns the token (or the error)
    if token is None:
        agreed: Any = None
        if rank == 0:
            try:
                agreed = create_files(path, tensors, files, shards)
            except OSError as err:
                agreed = err
        agreed = _agree(agreed, group, world)[0]
        if isinstance(agreed, BaseException):
            raise agreed
        token = agreed
    # 2. every rank writes its own parts; 3. one all-gather of the pieces
    mine: Any
    try:
        mine = _write_own(path, tensors, plan, token, writers, rank, world)
    except Exception as err:  # noqa: BLE001 - every rank raises it below
        mine = err
    results = _agree(mine, group, world)
    # 4. rank 0 checks, combines, renames and commits; the others learn the outcome
    outcome: BaseException | None = None
    if rank == 0:
        try:
            outcome = next((_failed(r, e) for r, e in enumerate(results)
                            if isinstance(e, BaseException)), None)
            if outcome is None:
                _commit(path, files, layouts, results, token, index, index_name, prefix, texts)
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            outcome = err
        if outcome is not None:
            _remove_temps(path, files, token)
    outcome = _agree(outcome, group, world)[0]
    if isinstance(mine, BaseException):
        raise mine
    if outcome is not None:
        raise outcome


def _failed(rank: int, error: BaseException) -> CheckpointError:
    return CheckpointError(f"rank {rank} failed to write its part of the checkpoint: {error!r}")


def _commit(
    path: str,
    files: Sequence[str],
    layouts: Mapping[str, tuple[bytes, int]],
    results: Sequence[list[Piece]],
    token: str,
    index: dict[str, Any] | None,
    index_name: str,
    prefix: str,
    texts: Mapping[str, str] | None,
) -> None:
    """Rank 0: check the tiling, combine the CRCs, give the files their names, commit."""
    by_file: dict[str, list[Piece]] = {
        f: [Piece(f, 0, len(header), crc32(header))] for f, (header, _) in layouts.items()
    }
    for piece in (p for pieces in results for p in pieces):
        by_file.setdefault(piece.file, []).append(piece)
    check_tiling([p for pieces in by_file.values() for p in pieces],
                 {f: size for f, (_, size) in layouts.items()})
    meta = {f: {"size": layouts[f][1], "crc32": combine_pieces(by_file[f])} for f in files}
    renamed: list[str] = []
    try:
        for file in files:  # every file is durable (each rank's fsync) before its rename
            _rename(os.path.join(path, _temp_name(file, token)), os.path.join(path, file))
            renamed.append(file)
        durable.fsync_directory(path)
        if index is None:
            logger.info("saved in place to %s", [os.path.join(path, f) for f in files])
            return
        index["metadata"]["files"] = dict(sorted(meta.items()))
        commit_index(path, index_name, index, prefix, texts)  # the commit point
    except BaseException:
        if index is not None and not set(files) <= referenced_files(path, index_name):
            _remove_files(path, renamed)  # not committed: the renamed files are this save's
        raise
    logger.info("%s checkpoint saved in place to %s", prefix, path)


def _remove_files(path: str, files: Sequence[str]) -> None:
    for file in files:
        try:
            os.remove(os.path.join(path, file))
        except FileNotFoundError:
            pass
