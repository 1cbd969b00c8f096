"""Which model checkpoint a path holds, and readers for the formats users already have.

:func:`detect_model_checkpoint` recognises a Colossal checkpoint directory, a Hugging Face
model directory (``model.safetensors``, safetensors shards with
``model.safetensors.index.json``, ``pytorch_model.bin`` or its sharded index), a single
``.safetensors`` file and a ``torch.save``'d state dict. Anything else gets an error that
says what the path is. :func:`open_model_reader` gives a
:class:`~colossal.checkpoint_io.reader.TensorReader` over the foreign formats, with a
``module.`` prefix (a DDP-wrapped model's ``state_dict``) dropped when the model has none.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from colossal.checkpoint_io.index import CheckpointError
from colossal.checkpoint_io.reader import TensorReader

logger = logging.getLogger(__name__)

__all__ = [
    "COLOSSAL",
    "HF_BIN",
    "HF_SAFETENSORS",
    "SAFETENSORS_FILE",
    "TORCH_FILE",
    "ModelSource",
    "StateDictReader",
    "describe_file",
    "detect_model_checkpoint",
    "open_model_reader",
]

COLOSSAL = "colossal"
HF_SAFETENSORS = "hf-safetensors"
HF_BIN = "hf-bin"
SAFETENSORS_FILE = "safetensors-file"
TORCH_FILE = "torch-file"

MODEL_INDEX = "model.safetensors.index.json"
HF_SAFETENSORS_FILE = "model.safetensors"
HF_BIN_FILE = "pytorch_model.bin"
HF_BIN_INDEX = "pytorch_model.bin.index.json"
_PREFIX = "module."
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}(\.\d+)?\.safetensors$")
_EXPECTED = (
    "expected a Colossal or Hugging Face checkpoint directory (model.safetensors.index.json, "
    "model.safetensors or pytorch_model.bin), a .safetensors file or a torch.save'd state dict"
)


@dataclass(frozen=True)
class ModelSource:
    """A model checkpoint found at a path.

    Attributes:
        kind: One of :data:`COLOSSAL`, :data:`HF_SAFETENSORS`, :data:`HF_BIN`,
            :data:`SAFETENSORS_FILE`, :data:`TORCH_FILE`.
        path: The path given (a file or a directory).
        directory: The directory holding its files.
        files: Its files (tensor name -> file) for the foreign formats; empty for
            :data:`COLOSSAL` (its validated index gives them).
        description: What was found, for the log and error messages.
    """

    kind: str
    path: str
    directory: str
    description: str
    files: Mapping[str, str] = field(default_factory=dict)


def detect_model_checkpoint(path: str) -> ModelSource:
    """What model checkpoint ``path`` holds (reads only headers and indexes).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: ``path`` exists but is no model checkpoint (the message says what
            it is), or a save to it was interrupted before anything was committed.
    """
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return _detect_directory(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: it does not exist")
    directory, name = os.path.split(os.path.abspath(path))
    if _is_safetensors(path) or path.endswith(".safetensors"):
        return ModelSource(
            SAFETENSORS_FILE,
            path,
            directory,
            f"a safetensors file {path}",
            {k: name for k in _safetensors_keys(path)},
        )
    if _is_torch_file(path):
        return ModelSource(TORCH_FILE, path, directory, f"a torch.save'd state dict {path}", {})
    raise CheckpointError(f"{describe_file(path)}, not a checkpoint: {_EXPECTED}")


def _detect_directory(path: str) -> ModelSource:
    index_path = os.path.join(path, MODEL_INDEX)
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        metadata = index.get("metadata") or {}
        if metadata.get("format") == COLOSSAL or "files" in metadata:
            return ModelSource(COLOSSAL, path, path, f"a Colossal checkpoint directory {path}")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path} has no weight_map: it is not a model index")
        shards = sorted(set(weight_map.values()))
        missing = [f for f in shards if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(
                f"{index_path} references files that do not exist: {missing[:5]}; the "
                "Hugging Face checkpoint is incomplete"
            )
        return _hf(HF_SAFETENSORS, path, f"{len(shards)} safetensors shards", weight_map)
    interrupted = os.path.isdir(os.path.join(path, ".colossal-model-save"))
    if interrupted or any(_SHARD.match(n) for n in os.listdir(path)):  # shards, but no index
        raise CheckpointError(
            f"{index_path} does not exist: {path!r} is not a complete Colossal checkpoint "
            "(was the save interrupted, or the index deleted?)"
        )
    single = os.path.join(path, HF_SAFETENSORS_FILE)
    if os.path.isfile(single):
        files = dict.fromkeys(_safetensors_keys(single), HF_SAFETENSORS_FILE)
        return _hf(HF_SAFETENSORS, path, HF_SAFETENSORS_FILE, files)
    bin_index = os.path.join(path, HF_BIN_INDEX)
    if os.path.isfile(bin_index):
        weight_map = _read_json(bin_index).get("weight_map") or {}
        return _hf(HF_BIN, path, "sharded pytorch_model.bin", weight_map)
    if os.path.isfile(os.path.join(path, HF_BIN_FILE)):
        return _hf(HF_BIN, path, HF_BIN_FILE, {})
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "nothing"
    raise CheckpointError(f"directory {path!r} holds no model checkpoint ({shown}): {_EXPECTED}")


def _hf(kind: str, path: str, what: str, files: Mapping[str, str]) -> ModelSource:
    return ModelSource(kind, path, path, f"a Hugging Face model directory {path} ({what})", files)


def open_model_reader(source: ModelSource, expected: Collection[str]) -> TensorReader:
    """A reader over a foreign-format checkpoint, its names matched to the model's.

    Args:
        source: A non-Colossal :class:`ModelSource`.
        expected: The model's tensor names; a ``module.`` prefix on every stored name is
            dropped when none of these has it.

    Raises:
        CheckpointError: A ``torch.save``'d file that is not a state dict of tensors.
    """
    if source.kind in (TORCH_FILE, HF_BIN):
        if source.kind == TORCH_FILE:
            files = [os.path.basename(source.path)]
        else:
            files = sorted(set(source.files.values())) or [HF_BIN_FILE]
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(_load_state_dict(os.path.join(source.directory, file)))
        renamed = _strip_prefix(list(tensors), expected)
        return StateDictReader(source.directory, {renamed.get(k, k): v for k, v in tensors.items()})
    renamed = _strip_prefix(list(source.files), expected)
    if not renamed:
        return TensorReader(source.directory, dict(source.files))
    return _RenamedReader(source.directory, dict(source.files), renamed)


def _strip_prefix(names: list[str], expected: Collection[str]) -> dict[str, str]:
    """Stored name -> model name when every stored name has the ``module.`` prefix."""
    if not names or not all(n.startswith(_PREFIX) for n in names):
        return {}
    if any(n.startswith(_PREFIX) for n in expected):
        return {}
    logger.info("dropping the %r prefix of the checkpoint's tensor names", _PREFIX)
    return {n: n[len(_PREFIX) :] for n in names}


class StateDictReader(TensorReader):
    """A :class:`TensorReader` over tensors already in memory (a loaded ``torch.save`` file).

    Args:
        directory: Where the tensors came from (for messages).
        tensors: Name -> tensor.
    """

    def __init__(self, directory: str, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__(directory, dict.fromkeys(tensors, "<state dict>"))
        self._tensors = dict(tensors)

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return self._tensors[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``tensor[index]`` (the whole tensor when ``index`` is None)."""
        tensor = self._tensor(name)
        return tensor if index is None else tensor[index]

    def shape(self, name: str) -> list[int]:
        """The stored shape of ``name``."""
        return list(self._tensor(name).shape)

    def preload(self, names: Iterable[str] | None = None, num_threads: int = 1) -> int:
        """Nothing to read: the tensors are already in memory (returns 0)."""
        return 0

    def close(self) -> None:
        """Drop the tensors."""
        self._tensors.clear()


class _RenamedReader(TensorReader):
    """Safetensors files whose stored names differ from the names asked for."""

    def __init__(self, directory: str, weight_map: dict[str, str], renamed: dict[str, str]):
        super().__init__(directory, {renamed.get(k, k): f for k, f in weight_map.items()})
        self._stored = {renamed.get(k, k): k for k in weight_map}

    def _stored_name(self, name: str) -> str:
        return self._stored[name]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``tensor[index]`` (the whole tensor when ``index`` is None), read from disk."""
        if name in self._loaded:
            return super().read(name, index)
        handle, key = self._open(name), self._stored[name]
        return handle.get_tensor(key) if index is None else handle.get_slice(key)[index]

    def shape(self, name: str) -> list[int]:
        """The stored shape of ``name``."""
        if name in self._loaded:
            return super().shape(name)
        return list(self._open(name).get_slice(self._stored[name]).get_shape())


# ---- file sniffing ------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            value = json.load(file)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the index is corrupt") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an index")
    return value


def _is_safetensors(path: str) -> bool:
    """Whether the file starts like safetensors: an 8-byte header length, then JSON."""
    with open(path, "rb") as file:
        head = file.read(9)
    if len(head) < 9:
        return False
    length = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < length <= os.path.getsize(path) - 8


def _safetensors_keys(path: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            return list(handle.keys())
    except Exception as err:  # noqa: BLE001 - any parse error means "not valid"
        raise CheckpointError(f"{path} is not a valid safetensors file: {err}") from err


def _is_torch_file(path: str) -> bool:
    """A ``torch.save`` file: a zip archive with a ``data.pkl``, or a legacy pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith("data.pkl") for n in archive.namelist())
    with open(path, "rb") as file:
        return file.read(1) == b"\x80"  # pickle protocol 2+


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save``'d state dict (loaded with ``weights_only=True``).

    Raises:
        CheckpointError: The file does not hold a dict of tensors (the message says what).
    """
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - anything torch.load refuses
        raise CheckpointError(
            f"{path} is not a torch.save'd state dict torch.load can read safely "
            f"(weights_only=True): {err}"
        ) from err
    if not isinstance(value, Mapping):
        raise CheckpointError(
            f"{path} is a torch.save'd {type(value).__name__}, not a state dict: {_EXPECTED}"
        )
    others = sorted(str(k) for k, v in value.items() if not isinstance(v, torch.Tensor))
    if others:
        raise CheckpointError(
            f"{path} is a torch.save'd dict whose entries {others[:5]} are not tensors, not a "
            "model state dict: save model.state_dict() itself (or pass that entry's file)"
        )
    return {str(k): v for k, v in value.items()}


def describe_file(path: str) -> str:
    """What a file that is no checkpoint is, e.g. ``"notes.txt is a text file"``."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(4096)
    if size == 0:
        return f"{path} is an empty file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        stripped = text.lstrip()
        if stripped[:1] in ("{", "["):
            try:
                with open(path, encoding="utf-8") as file:
                    json.load(file)
                return f"{path} is a JSON file"
            except ValueError:
                pass
        return f"{path} is a text file"
    if zipfile.is_zipfile(path):
        return f"{path} is a zip archive of {size} bytes"
    return f"{path} is a binary file of {size} bytes (starting {head[:8].hex()})"
