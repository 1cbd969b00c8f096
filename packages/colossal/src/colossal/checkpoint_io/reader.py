"""TensorReader: reads whole tensors or slices from a checkpoint's safetensors shards.

Two ways to read (ColossalAI's ``low_cpu_mem_mode``): streamed (the default) reads each tensor,
or only the slice a rank keeps, when it is copied, so at most one tensor is held beyond the
model; :meth:`TensorReader.preload` first reads every tensor a load needs, whole, with one
file per thread (``num_threads`` files at once), and then serves the reads from memory:
more memory (the tensors read), fewer and larger reads, several files read in parallel.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors import safe_open

from colossal.core import LocalPart
from colossal.core.io import load_safetensors

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
        self._loaded: dict[str, torch.Tensor] = {}

    def _stored_name(self, name: str) -> str:
        """The name ``name`` is stored under in its file."""
        return name

    def preload(self, names: Iterable[str] | None = None, num_threads: int = 1) -> int:
        """Read ``names`` (every tensor when None) whole into memory, ``num_threads`` files at once.

        Later :meth:`read`, :meth:`read_part` and :meth:`shape` calls for them are served from
        memory. Names not in the checkpoint are skipped (the load reports them).

        Returns:
            The number of bytes read.

        Raises:
            ValueError: ``num_threads`` is not a positive int.
        """
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads={num_threads!r} must be a positive int")
        wanted = self.weight_map if names is None else [n for n in names if n in self.weight_map]
        by_file: dict[str, list[str]] = {}
        for name in wanted:
            if name not in self._loaded:
                by_file.setdefault(self.weight_map[name], []).append(name)

        def read_file(item: tuple[str, list[str]]) -> dict[str, torch.Tensor]:
            file, names_here = item
            stored = {self._stored_name(n): n for n in names_here}
            loaded = load_safetensors(os.path.join(self.directory, file), list(stored))
            return {stored[key]: tensor for key, tensor in loaded.items()}

        jobs = sorted(by_file.items())
        if num_threads == 1 or len(jobs) <= 1:
            results = [read_file(job) for job in jobs]
        else:
            with ThreadPoolExecutor(min(num_threads, len(jobs))) as pool:
                results = list(pool.map(read_file, jobs))
        read = 0
        for result in results:
            for name, tensor in result.items():
                self._loaded[name] = tensor
                read += tensor.numel() * tensor.element_size()
        return read

    def _open(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(os.path.join(self.directory, file), framework="pt")
        return self._files[file]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``tensor[index]`` (the whole tensor when ``index`` is None), read from disk."""
        if name in self._loaded:
            held = self._loaded[name]
            return held if index is None else held[index]
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
        if name in self._loaded:
            return list(self._loaded[name].shape)
        return list(self._open(name).get_slice(name).get_shape())

    def close(self) -> None:
        """Drop the open file handles and the preloaded tensors."""
        self._files.clear()
        self._loaded.clear()
