"""TensorReader: reads whole tensors or slices from a checkpoint's safetensors shards."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open

from colossal.core import LocalPart

__all__ = ["TensorReader"]


class TensorReader:
    """Reads whole tensors or slices from a checkpoint's shards (``safe_open.get_slice``).

    Args:
        directory: The checkpoint directory.
        weight_map: Tensor name -> shard file.
    """

    def __init__(self, directory: str, weight_map: dict[str, str]) -> None:
        self.directory = directory
        self.weight_map = weight_map
        self._files: dict[str, Any] = {}

    def _open(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.directory, file), framework="pt")
        return self._files[file]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``tensor[index]`` (the whole tensor when ``index`` is None), read from disk."""
        handle = self._open(name)
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def read_part(self, name: str, part: LocalPart) -> torch.Tensor:
        """Only the elements of ``name`` that ``part`` describes (shaped as ``part.read``).

        Reads with ``get_slice``: a block exactly, a flat range as the rows covering it.

        Raises:
            ValueError: ``part`` does not fit the stored tensor.
        """
        return part.read(lambda index: self.read(name, index), self.shape(name))

    def shape(self, name: str) -> list[int]:
        """The stored shape of ``name``."""
        return list(self._open(name).get_slice(name).get_shape())

    def close(self) -> None:
        """Drop the open file handles."""
        self._files.clear()
