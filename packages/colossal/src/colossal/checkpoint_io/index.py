"""Checkpoint index files: shard planning, file sizes and checksums, validation.

A model directory follows the Hugging Face layout (``model.safetensors`` or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``); the index also
records, per file, its size in bytes and CRC-32, so an incomplete or corrupt checkpoint is
refused before anything is loaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from colossal.checkpoint_io.checksum import crc32

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "crc32_from_tensors",
    "file_crc32",
    "plan_shards",
    "read_index",
    "shard_file_names",
]

FORMAT_VERSION = 1
"""Version of Colossal's checkpoint format, stored in every index."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit what it is loaded into."""


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split names into consecutive shards of at most ``max_bytes`` (a larger tensor alone).

    Args:
        sizes: ``(name, nbytes)`` in file order.
        max_bytes: Byte budget of one shard (> 0).
    """
    if max_bytes <= 0:
        raise ValueError(f"size_per_shard must be > 0 MB, got {max_bytes} bytes")
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(prefix: str, count: int) -> list[str]:
    """``prefix.safetensors`` for one shard, else ``prefix-0000k-of-0000n.safetensors``."""
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def file_crc32(path: str, chunk: int = 16 * 1024 * 1024) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as file:
        while True:
            data = file.read(chunk)
            if not data:
                break
            crc = crc32(data, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def crc32_from_tensors(path: str, tensors: Mapping[str, torch.Tensor]) -> str | None:
    """CRC-32 of a just-written safetensors file, from its header and the in-memory tensors.

    Avoids reading the data back from disk (direct-IO writes bypass the page cache). Returns
    None when numpy is unavailable or the tensors do not match the header.
    """
    try:
        import numpy  # noqa: F401 - only needed for a zero-copy byte view
    except ImportError:
        return None
    with open(path, "rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little")
        header_bytes = file.read(length)
    header = json.loads(header_bytes)
    entries = sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"][0],
    )
    crc = crc32(header_bytes, crc32(prefix))
    for name, info in entries:
        tensor = tensors.get(name)
        if tensor is None:
            return None
        data = tensor.detach().cpu().contiguous().reshape(-1).view(_uint8()).numpy()
        begin, end = info["data_offsets"]
        if data.nbytes != end - begin:
            return None
        # numpy's stubs give ndarray its __buffer__ for Python >= 3.12 only (mypy checks 3.10).
        crc = crc32(data, crc)  # type: ignore[arg-type]
    return f"{crc & 0xFFFFFFFF:08x}"


def _uint8() -> Any:
    import torch

    return torch.uint8


def read_index(
    directory: str,
    index_name: str,
    verify_checksums: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Read and validate an index: every file present, of the recorded size and checksum.

    Every rank checks that every file exists with the recorded size (a ``stat``, no reads).
    The CRC-32s are checked once per file over the whole group: file ``i`` (in name order)
    is read by rank ``i % world``, and the ranks agree on the verdict, so a corrupt file is
    refused on every rank while each rank reads only its share. With more than one rank
    this is collective over ``group``: every rank of it must call it.

    Args:
        directory: The checkpoint directory.
        index_name: The index file name inside it.
        verify_checksums: Also compare each file's CRC-32.
        group: The ranks loading together (the whole job when None; local without
            ``torch.distributed``).

    Returns:
        The parsed index.

    Raises:
        CheckpointError: The index or a file is missing, or a size/checksum differs (on
            every rank of the group, whichever rank found it).
    """
    rank, world = _rank_world(group)
    index: dict[str, Any] | None = None
    errors: list[str] = []
    try:
        index, files = _load_index(directory, index_name)
        for name in files:
            _check_size(os.path.join(directory, name), files[name])
        if verify_checksums:
            for i, name in enumerate(sorted(files)):
                if i % world == rank:
                    _check_crc(os.path.join(directory, name), files[name])
    except CheckpointError as err:
        errors.append(str(err))
    except OSError as err:  # every rank must still join the verdict below
        errors.append(f"cannot read the checkpoint {directory!r}: {err}")
    if world > 1:
        from colossal.core.comm import all_gather_object

        verdicts = all_gather_object(errors, group)
        errors = [
            e if r == rank else f"{e} (found by rank {r})"
            for r, found in enumerate(verdicts)
            for e in found
        ]
    if errors:
        # Every rank reports the same first error, so the message names the bad file.
        raise CheckpointError(errors[0] + (f" [{len(errors) - 1} more]" if len(errors) > 1 else ""))
    assert index is not None
    return index


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _load_index(directory: str, index_name: str) -> tuple[dict[str, Any], Mapping[str, Any]]:
    path = os.path.join(directory, index_name)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} does not exist: {directory!r} is not a complete Colossal checkpoint "
            "(was the save interrupted, or is this the wrong directory?)"
        )
    try:
        with open(path, encoding="utf-8") as file:
            index = json.load(file)
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}); the checkpoint is corrupt"
        ) from err
    files: Mapping[str, Any] = index.get("metadata", {}).get("files", {})
    weight_map: Mapping[str, str] = index.get("weight_map", {})
    missing = sorted(set(weight_map.values()) - set(files))
    if missing:
        raise CheckpointError(f"{path} maps tensors to files it does not describe: {missing}")
    return index, files


def _check_size(path: str, info: Mapping[str, Any]) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete")
    size = os.path.getsize(path)
    if size != info.get("size"):
        raise CheckpointError(
            f"checkpoint file {path} has {size} bytes, the index records {info.get('size')}: "
            "the file is truncated or corrupt"
        )


def _check_crc(path: str, info: Mapping[str, Any]) -> None:
    if "crc32" not in info:
        return
    crc = file_crc32(path)
    if crc != info["crc32"]:
        raise CheckpointError(
            f"checkpoint file {path} has CRC-32 {crc}, the index records {info['crc32']}: "
            "the file is corrupt"
        )
