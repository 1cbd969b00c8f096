"""Encoding and decoding of the safetensors header, shared by the writer and the readers.

File layout (the format of the Hugging Face ``safetensors`` library): an 8-byte little-endian
unsigned header length ``N``; ``N`` bytes of JSON, padded with spaces so the data starts at a
multiple of 8; then the raw little-endian tensor bytes. The JSON maps each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data start) and
may hold ``"__metadata__"``, a str -> str dict.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest header accepted (the safetensors library has the same limit)."""

METADATA_KEY = "__metadata__"
_ALIGNMENT = 8
_DTYPE_ATTRS = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
STR_TO_DTYPE: dict[str, torch.dtype] = {
    code: getattr(torch, attr) for code, attr in _DTYPE_ATTRS.items() if hasattr(torch, attr)
}
DTYPE_TO_STR: dict[torch.dtype, str] = {dtype: code for code, dtype in STR_TO_DTYPE.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file.

    Attributes:
        name: Tensor name (the key in the header).
        dtype: torch dtype of the stored elements.
        shape: Tensor shape.
        begin: First byte of the tensor, relative to the start of the data section.
        end: One past the last byte, relative to the start of the data section.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """Number of bytes the tensor occupies in the file."""
        return self.end - self.begin

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed and validated header of a safetensors file.

    Attributes:
        path: The file the header was read from.
        tensors: Tensor name -> :class:`TensorInfo`, in header order.
        metadata: The ``"__metadata__"`` dict, or ``None`` when the file has none.
        data_start: Absolute file offset of the data section.
    """

    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int

    def select(self, keys: Iterable[str] | None) -> list[TensorInfo]:
        """The infos of ``keys`` (all tensors when ``None``), in the order asked.

        Raises:
            KeyError: A key is not in the file; the message names the file and the key.
        """
        if keys is None:
            return list(self.tensors.values())
        if isinstance(keys, str):
            keys = [keys]
        selected = []
        for key in keys:
            info = self.tensors.get(key)
            if info is None:
                known = sorted(self.tensors)
                shown = ", ".join(repr(k) for k in known[:8]) + (", ..." if len(known) > 8 else "")
                raise KeyError(
                    f"{self.path}: no tensor named {key!r} ({len(known)} tensors: {shown})"
                )
            selected.append(info)
        return selected


def layout_tensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[TensorInfo]]:
    """Validate ``tensors`` and lay them out like ``safetensors.torch.save_file`` does.

    Tensors are ordered by decreasing element size, then by name, so that every tensor starts
    at a multiple of its element size.

    Args:
        tensors: Name -> tensor (any device, dtype in :data:`DTYPE_TO_STR`, strided layout).
        metadata: Optional str -> str dict stored under ``"__metadata__"``.

    Returns:
        The bytes that precede the data (length prefix + padded JSON) and the tensor infos in
        file order.

    Raises:
        TypeError: ``tensors`` is not a mapping of str to tensors, or ``metadata`` is not a
            mapping of str to str.
        ValueError: A tensor is sparse, nested, on the meta device, or has an unsupported dtype.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors IO is only implemented on little-endian hosts")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of str to torch.Tensor, got {type(tensors)}")
    for name, tensor in tensors.items():
        _check_tensor(name, tensor)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    infos: list[TensorInfo] = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        infos.append(TensorInfo(name, tensor.dtype, tuple(tensor.shape), offset, offset + nbytes))
        offset += nbytes
    return encode_header(infos, _check_metadata(metadata)), infos


def encode_header(infos: Iterable[TensorInfo], metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix and the space-padded JSON header for ``infos``."""
    header: dict[str, object] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    for info in infos:
        header[info.name] = {
            "dtype": DTYPE_TO_STR[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [info.begin, info.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def parse_header_length(prefix: bytes, file_size: int, path: str) -> int:
    """Decode and check the 8-byte length prefix.

    Raises:
        ValueError: The file is too short, or the header length is beyond the file size.
    """
    if len(prefix) < 8 or file_size < 8:
        raise ValueError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise ValueError(
            f"{path}: header length {length} exceeds {MAX_HEADER_BYTES} bytes; "
            "the file is corrupt or not a safetensors file"
        )
    if 8 + length > file_size:
        raise ValueError(
            f"{path}: header length {length} is beyond the file size {file_size}; "
            "the file is truncated or not a safetensors file"
        )
    return length


def parse_header(raw: bytes, file_size: int, path: str) -> SafetensorsHeader:
    """Decode and validate the JSON header ``raw`` of a file of ``file_size`` bytes.

    Raises:
        ValueError: The JSON is invalid, an entry is malformed, or a tensor's data offsets are
            inconsistent with its shape or beyond the end of the file.
    """
    data_start = 8 + len(raw)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError(f"{path}: {METADATA_KEY} must map str to str")
    data_bytes = file_size - data_start
    tensors = {name: _parse_entry(path, name, entry, data_bytes) for name, entry in header.items()}
    return SafetensorsHeader(os.fspath(path), tensors, metadata, data_start)


def _parse_entry(path: str, name: str, entry: object, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: header entry {name!r} is not an object")
    code = entry.get("dtype")
    dtype = STR_TO_DTYPE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {code!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _is_int_list(shape) or any(d < 0 for d in shape):
        raise ValueError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * _element_size(dtype)
    if end - begin != expected:
        raise ValueError(
            f"{path}: tensor {name!r} data_offsets {offsets} span {end - begin} bytes but its "
            f"dtype and shape {shape} need {expected}; the file is corrupt"
        )
    if end > data_bytes:
        raise ValueError(
            f"{path}: tensor {name!r} data_offsets {offsets} are out of range: the data section "
            f"has only {max(data_bytes, 0)} bytes; the file is truncated or corrupt"
        )
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _is_int_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_tensor(name: object, tensor: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be str, got {name!r} ({type(name).__name__})")
    if name == METADATA_KEY:
        raise ValueError(f"{METADATA_KEY!r} is reserved for metadata; rename that tensor")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"value of {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_nested:
        raise ValueError(
            f"tensor {name!r} has layout {tensor.layout}; only dense tensors can be saved "
            "(call .to_dense() first)"
        )
    if tensor.device.type == "meta":
        raise ValueError(f"tensor {name!r} is on the meta device and has no data to save")
    if tensor.dtype not in DTYPE_TO_STR:
        raise ValueError(
            f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store; "
            f"supported: {', '.join(str(d) for d in DTYPE_TO_STR)}"
        )


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise TypeError(f"metadata must be a mapping of str to str, got {metadata!r}")
    return dict(metadata)
