"""Async tensor file IO: crash-safe safetensors writes in the background, and partial reads.

Files are plain safetensors (readable by ``safetensors.torch.load_file`` and
``transformers``); numpy is not needed.

Example:
    >>> from colossal.core.io import AsyncTensorWriter, load_safetensors
    >>> with AsyncTensorWriter() as writer:
    ...     handle = writer.save({"w": torch.ones(2, 3)}, "/tmp/w.safetensors")
    ...     handle.wait()
    >>> load_safetensors("/tmp/w.safetensors")["w"].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from colossal.core.io._buffers import ALIGNMENT, empty_aligned, tensor_memoryview
from colossal.core.io.adopt import adopt_optimizer_state, adopt_tensors
from colossal.core.io.handle import AsyncHandle, ReadHandle, WriteHandle
from colossal.core.io.reader import (
    AsyncTensorReader,
    load_safetensors,
    load_safetensors_async,
    read_safetensors_header,
    read_tensor_slice,
)
from colossal.core.io.safetensors_format import SafetensorsHeader, TensorInfo
from colossal.core.io.tensor_file import (
    TensorFileIO,
    direct_io_supported,
    read_tensor_file_async,
    write_tensor_file_async,
)
from colossal.core.io.writer import AsyncTensorWriter, save_safetensors, save_safetensors_async

__all__ = [
    "ALIGNMENT",
    "AsyncHandle",
    "AsyncTensorReader",
    "AsyncTensorWriter",
    "ReadHandle",
    "SafetensorsHeader",
    "TensorFileIO",
    "TensorInfo",
    "WriteHandle",
    "adopt_optimizer_state",
    "adopt_tensors",
    "direct_io_supported",
    "empty_aligned",
    "load_safetensors",
    "load_safetensors_async",
    "read_safetensors_header",
    "read_tensor_file_async",
    "read_tensor_slice",
    "save_safetensors",
    "save_safetensors_async",
    "tensor_memoryview",
    "write_tensor_file_async",
]
