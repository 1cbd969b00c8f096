"""Crash-safe saves that share a directory: each kind commits by replacing its own index.

A checkpoint directory may hold a model (``model*.safetensors`` + ``model.safetensors.index.json``
+ the config files written with it), an optimizer (``optimizer*.safetensors`` +
``optimizer.safetensors.index.json``), an lr scheduler (``lr_scheduler.json``) and any files
and folders of the user. A save touches only its own kind:

1. The new shards are written next to the old ones under names the current index of that
   kind does not reference (:func:`choose_file_names`: ``model.safetensors`` and
   ``model-00001-of-00001.safetensors`` take turns, sharded names get a ``.1`` suffix every
   other save), each through a hidden temporary file and an atomic rename. The ranks record
   their files' sizes and checksums in a hidden staging folder ``.colossal-<kind>-save``.
2. Rank 0 replaces the index atomically (:func:`commit_index`): this is the commit point.
   Before it the old index and every file it references are untouched, so the previous
   checkpoint of that kind loads; after it the new one does.
3. The config files are written, then the files of that kind which the new index does not
   reference (stale shards, temporary files of killed writers) and the staging folder are
   deleted. A crash here leaves only garbage that the next save of that kind removes.

Nothing else in the directory is ever renamed, replaced or deleted, and a save into a
directory without write permission fails with :class:`PermissionError` before any file is
written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from colossal.checkpoint_io import durable

logger = logging.getLogger(__name__)

__all__ = [
    "choose_file_names",
    "commit_index",
    "prepare_directory",
    "referenced_files",
    "resolve_directory",
    "staging_directory",
]

_LEGACY_OLD = ".colossal-old"
"""Left by the directory swap of Colossal <= 0.1 after a crash between its renames."""


def staging_directory(path: str, prefix: str) -> str:
    """The hidden folder in ``path`` where the ranks of a ``prefix`` save meet."""
    return os.path.join(os.path.normpath(path), f".colossal-{prefix}-save")


def prepare_directory(path: str) -> bool:
    """Create ``path`` if needed and check that a save may write into it.

    Returns:
        Whether ``path`` was created.

    Raises:
        PermissionError: ``path`` is read-only (no write bit, even for root) or not writable
            by this process.
        NotADirectoryError: ``path`` is a file.
    """
    path = os.path.normpath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(
            f"cannot save a sharded checkpoint to {path!r}: it is a file, not a directory; "
            "pass a directory"
        )
    created = not os.path.exists(path)
    if created:
        os.makedirs(path)
    mode = os.stat(path).st_mode
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK):
        raise PermissionError(
            f"cannot save a checkpoint into {path!r}: the directory is read-only "
            f"(mode {stat.S_IMODE(mode):o}); make it writable or save somewhere else"
        )
    return created


def referenced_files(directory: str, index_name: str) -> set[str]:
    """Files the committed index ``index_name`` in ``directory`` references (empty if none)."""
    try:
        with open(os.path.join(directory, index_name), encoding="utf-8") as file:
            index = json.load(file)
    except (OSError, ValueError):
        return set()
    if not isinstance(index, dict):
        return set()
    files = set(index.get("weight_map", {}).values())
    files.update(index.get("metadata", {}).get("files", {}))
    return {f for f in files if isinstance(f, str)}


def _candidates(prefix: str, count: int) -> list[list[str]]:
    if count == 1:
        first = [[f"{prefix}.safetensors"], [f"{prefix}-00001-of-00001.safetensors"]]
    else:
        first = [[f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]]
    suffixed = [
        [f"{prefix}-{i + 1:05d}-of-{count:05d}.{g}.safetensors" for i in range(count)]
        for g in range(1, 4)
    ]
    return first + suffixed


def choose_file_names(directory: str, index_name: str, prefix: str, count: int) -> list[str]:
    """Names for ``count`` new shards that the committed index of this kind does not use.

    The Hugging Face names (``prefix.safetensors`` or ``prefix-0000k-of-0000n.safetensors``)
    unless the current checkpoint uses them; then another set, so the current checkpoint
    stays intact until the new index replaces its index.
    """
    taken = referenced_files(directory, index_name)
    for names in _candidates(prefix, count):
        if taken.isdisjoint(names):
            return names
    raise AssertionError("unreachable: the candidate name sets are disjoint")


def _own_file(prefix: str, index_name: str) -> re.Pattern[str]:
    """Shards of this kind, and hidden temporary files of its shards and index."""
    shard = rf"{re.escape(prefix)}(-\d{{5}}-of-\d{{5}}(\.\d+)?)?\.safetensors"
    temp = rf"\.({shard}|{re.escape(index_name)})\.[0-9a-f]{{12}}\.tmp"
    return re.compile(rf"^({shard}|{temp})$")


def commit_index(
    directory: str,
    index_name: str,
    index: Mapping[str, Any],
    prefix: str,
    texts: Mapping[str, str] | None = None,
) -> None:
    """Commit a save whose shards are written: replace the index, then clean up (rank 0).

    Args:
        directory: The checkpoint directory.
        index_name: The index of this kind (e.g. ``model.safetensors.index.json``).
        index: The new index; its files must be durable in ``directory``.
        prefix: The shard name prefix of this kind (``model`` or ``optimizer``).
        texts: Other files of this kind (name -> text, e.g. ``config.json``), written after
            the index.
    """
    durable.write_json(os.path.join(directory, index_name), dict(index))  # the commit point
    for name, text in (texts or {}).items():
        durable.write_text(os.path.join(directory, name), text)
    remove_stale(directory, index_name, prefix)
    durable.remove(staging_directory(directory, prefix))


def remove_stale(directory: str, index_name: str, prefix: str) -> list[str]:
    """Delete the files of this kind that its committed index does not reference.

    Returns:
        The deleted names.
    """
    keep = referenced_files(directory, index_name)
    if not keep:  # no committed checkpoint of this kind: nothing is known to be stale
        return []
    own = _own_file(prefix, index_name)
    stale = sorted(n for n in os.listdir(directory) if own.match(n) and n not in keep)
    for name in stale:
        durable.remove(os.path.join(directory, name))
    if stale:
        logger.debug("removed stale %s files from %s: %s", prefix, directory, stale)
    return stale


def resolve_directory(path: str) -> str:
    """The directory to load for ``path``.

    ``path`` itself when it is a directory; a ``<path>.colossal-old`` directory (left by the
    directory swap of earlier versions after a crash between its renames) otherwise.

    Raises:
        FileNotFoundError: Neither exists.
    """
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + _LEGACY_OLD):
        old = path + _LEGACY_OLD
        logger.warning("%s is missing; loading the previous checkpoint %s", path, old)
        return old
    raise FileNotFoundError(f"no checkpoint at {path!r}: it does not exist")
