"""Spread a save of named full tensors over the ranks, sync or async, into a shared directory.

Every rank plans the same shards; each shard is written by the rank that has written the
fewest bytes so far (the same choice on every rank), straight into the checkpoint directory
under names the current checkpoint of that kind does not use (:mod:`.commit`). When its
files are durable a rank records their sizes and checksums in ``rank<r>.meta.json`` in the
kind's hidden staging folder; rank 0 waits for all of them and commits by replacing the
index. With ``use_async`` the tensors are snapshotted to CPU and all of this happens in the
background; tensors named in ``background`` are even snapshotted on a background thread, and
:meth:`ShardedSaver.wait_snapshots` is the fence before anything may modify them. A sync save
of FlatRange-sharded state can skip the gathers: every rank writes its own bytes in place
(:mod:`.inplace`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from colossal.checkpoint_io import durable
from colossal.checkpoint_io.commit import (
    choose_file_names,
    commit_index,
    prepare_directory,
    staging_directory,
)
from colossal.checkpoint_io.index import (
    FORMAT_VERSION,
    CheckpointError,
    crc32_from_tensors,
    file_crc32,
    plan_shards,
)
from colossal.checkpoint_io.inplace import (
    create_files,
    missing_root,
    remove_created,
    save_in_place,
    supports_in_place,
)
from colossal.checkpoint_io.sharded import TensorLike
from colossal.checkpoint_io.stream import Streamed, stream_part
from colossal.core.comm import all_gather_object, barrier
from colossal.core.io import AsyncTensorWriter, WriteHandle

logger = logging.getLogger(__name__)

__all__ = ["ShardedSaver"]

META_WAIT_SECONDS = 1800.0


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class ShardedSaver:
    """Writes checkpoints of named tensors over all ranks of ``group``.

    Args:
        group: The ranks that share the writing (the whole job when None).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._writer: AsyncTensorWriter | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colossal-ckpt")
        self._pending: list[Future[None]] = []
        self._pending_paths: dict[str, Future[None]] = {}
        self._bytes_written: list[int] = []
        self._snapshots: list[WriteHandle] = []

    @property
    def writer(self) -> AsyncTensorWriter:
        """The background safetensors writer (created on first use)."""
        if self._writer is None:
            self._writer = AsyncTensorWriter()
        return self._writer

    def save(
        self,
        tensors: Mapping[str, TensorLike],
        path: str,
        prefix: str,
        index_name: str,
        size_per_shard_mb: float,
        extra: Mapping[str, Any] | None = None,
        use_async: bool = False,
        gather: Callable[[TensorLike, int], torch.Tensor | None] | None = None,
        background: Collection[str] = (),
        extra_files: Mapping[str, str] | None = None,
        stream: bool = False,
        in_place: bool = False,
    ) -> None:
        """Save ``tensors`` (the same names on every rank) as a sharded directory ``path``.

        Collective over the group. ``extra`` is merged into the index JSON. ``gather`` turns
        a (possibly sharded) tensor into the full one; every rank calls it for every tensor in
        the same order with the rank (in the group) that writes the tensor's file, which is
        the only rank that needs the result (the others may get ``None``).
        With ``use_async``, the tensors named in ``background`` are snapshotted on a
        background thread after this returns: the caller must call :meth:`wait_snapshots`
        before modifying them. The others are copied before this returns. Rank 0 also
        writes ``extra_files`` (file name -> text, e.g. a Hugging Face ``config.json``) into
        the directory, committed together with the tensors. With ``stream`` (and not
        ``use_async``) each file is written tensor by tensor as they are gathered, in the
        order of ``tensors`` within each element size, and no gathered tensor is kept after
        it is written (see the module docstring). With ``in_place`` (and not ``use_async``),
        when every value is a tensor or holds a ``FlatRange`` part, nothing is gathered:
        every rank writes its own parts into the files (:mod:`.inplace`; the same bytes as
        ``stream``).
        """
        gather = gather or _identity
        key = staging_directory(os.path.abspath(path), prefix)
        self._wait_for_path(key)  # an earlier save of this kind here must be committed first
        rank, world = _rank_world(self.group)
        # Global sizes from shape and dtype: tensors and colossal.core.ShardedTensor alike.
        sizes = [(n, math.prod(t.shape) * t.dtype.itemsize) for n, t in tensors.items()]
        limit = size_per_shard_mb * 1024**2
        in_place = in_place and not use_async and supports_in_place(tensors)
        if in_place and world > 1:
            # At least one file per rank: the ranks start on different files (inplace.py), as
            # writers to one file share its inode lock.
            limit = min(limit, -(-sum(s for _, s in sizes) // world))
        shards = plan_shards(sizes, int(limit) if math.isfinite(limit) else sys.maxsize)
        # Rank 0 alone checks the directory and reads the committed index; all take its plan
        # (for an in-place save rank 0 has also created the files: the plan holds their token).
        plan = _plan(path, prefix, index_name, shards, tensors if in_place else None,
                     extra_files or ()) if rank == 0 else None
        if world > 1:
            plan = all_gather_object(plan, self.group)[0]
        if isinstance(plan, BaseException):
            raise plan
        assert isinstance(plan, dict)
        staging, files = staging_directory(path, prefix), plan["files"]
        if world > 1 and not in_place:  # in place, a rank that cannot see the files fails
            _check_shared_directory(path, plan, staging, rank, self.group)
        weight_map = {n: f for f, names in zip(files, shards, strict=True) for n in names}
        index = {
            "metadata": {
                "format": "colossal",
                "format_version": FORMAT_VERSION,
                "total_size": sum(s for _, s in sizes),
                "files": {},
            },
            "weight_map": weight_map,
            **(dict(extra) if extra else {}),
        }
        texts = dict(extra_files) if rank == 0 and extra_files else {}
        if in_place:
            try:
                save_in_place(tensors, path, files, shards, index, index_name, prefix, texts,
                              self._assign, self.group, token=plan["token"])
            except BaseException:
                if rank == 0:  # its temporary files are gone: the directory it created too
                    remove_created(path, plan["root"])
                raise
            return
        handles: list[tuple[str, Any, dict[str, torch.Tensor] | None]] = []
        nbytes = dict(sizes)
        writers = self._assign([sum(nbytes[n] for n in names) for names in shards], world)
        for writer, file, names in zip(writers, files, shards, strict=True):
            target = os.path.join(path, file)
            if stream and not use_async:
                streamed = stream_part(tensors, names, writer, rank, target, gather)
                if streamed is not None:
                    handles.append((file, streamed, None))
                continue
            handle, part = self._write_part(
                tensors, names, writer, rank, target, gather, background, use_async
            )
            if handle is not None:  # sync saves checksum the tensors in memory, not a re-read
                handles.append((file, handle, None if use_async else part))
        job = _Finalize(path, staging, prefix, index_name, index, handles, rank, world, texts)
        if use_async:
            future = self._executor.submit(job)
            self._pending.append(future)
            self._pending_paths[key] = future
        else:
            job()
            if world > 1:
                barrier(self.group)

    def _write_part(
        self,
        tensors: Mapping[str, TensorLike],
        names: list[str],
        writer: int,
        rank: int,
        target: str,
        gather: Callable[[TensorLike, int], torch.Tensor | None],
        background: Collection[str],
        use_async: bool,
    ) -> tuple[WriteHandle | None, dict[str, torch.Tensor]]:
        """Gather ``names`` for ``writer`` (every rank, in order); the writer starts the file."""
        part, fenced = {}, set()
        for n in names:
            full = gather(tensors[n], writer)  # may be collective: every rank, in order
            if writer == rank:
                assert full is not None
                part[n] = full.detach()
                if n in background or full is not tensors[n]:
                    fenced.add(n)  # nothing changes it before wait_snapshots()
        if writer != rank:
            return None, part
        in_background = use_async and bool(fenced)
        if in_background:  # the others are copied now, the fenced ones later
            part = {n: t if n in fenced else t.clone() for n, t in part.items()}
        handle = self.writer.save(
            part, target, {"format": "pt"}, copy=use_async, background_copy=in_background
        )
        if use_async:
            self._snapshots.append(handle)
        return handle, part

    def save_file(
        self,
        tensors: Mapping[str, TensorLike],
        path: str,
        use_async: bool = False,
        gather: Callable[[TensorLike, int], torch.Tensor | None] | None = None,
        background: Collection[str] = (),
        stream: bool = False,
        in_place: bool = False,
    ) -> None:
        """Save ``tensors`` as the one safetensors file ``path``, written by rank 0.

        Collective over the group; ``gather``, ``use_async``, ``background``, ``stream`` and
        ``in_place`` (every rank writes its own parts) as in :meth:`save`. The file is
        replaced atomically (a temporary file, then a rename); nothing next to it is touched.
        """
        key = os.path.abspath(path)
        self._wait_for_path(key)
        rank, world = _rank_world(self.group)
        names = list(tensors)
        in_place = in_place and not use_async and supports_in_place(tensors)
        folder, file = os.path.dirname(key), os.path.basename(key)
        outcome: str | BaseException | None = None  # rank 0: the in-place token or the error
        root = missing_root(folder) if rank == 0 else None  # what a failed save removes
        if rank == 0:
            try:
                os.makedirs(folder, exist_ok=True)
                if in_place:
                    outcome = create_files(folder, tensors, [file], [names])
            except OSError as err:
                remove_created(folder, root)
                outcome = err
        if world > 1:
            outcome = all_gather_object(outcome, self.group)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        if in_place:
            try:
                save_in_place(tensors, folder, [file], [names], None, "", "", None,
                              self._assign, self.group, token=outcome)
            except BaseException:
                remove_created(folder, root)
                raise
            return
        if stream and not use_async:
            stream_part(tensors, names, 0, rank, path, gather or _identity)
            if world > 1:
                barrier(self.group)
            if rank == 0:
                logger.info("model saved to %s", path)
            return
        handle, _ = self._write_part(
            tensors, names, 0, rank, path, gather or _identity, background, use_async
        )
        if handle is None:
            if not use_async and world > 1:
                barrier(self.group)
            return

        def finish() -> None:
            handle.wait()
            logger.info("model saved to %s", path)

        if use_async:
            future = self._executor.submit(finish)
            self._pending.append(future)
            self._pending_paths[key] = future
        else:
            try:
                finish()
            finally:
                if world > 1:
                    barrier(self.group)

    def wait_snapshots(self) -> None:
        """Wait until async saves no longer read the caller's tensors (a local fence).

        Errors of a failed snapshot are not raised here: the save fails with them, and
        :meth:`synchronize` reports it.
        """
        handles, self._snapshots = self._snapshots, []
        for handle in handles:
            try:
                handle.wait_released()
            except BaseException:  # noqa: BLE001, S110 - reported by synchronize()
                pass

    def synchronize(self) -> None:
        """Wait for this process's async saves, then for every rank's (collective).

        Raises:
            The first error of a failed background save.
        """
        pending, self._pending = self._pending, []
        self._pending_paths.clear()
        errors = []
        for future in pending:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)
        if pending and _rank_world(self.group)[1] > 1:
            barrier(self.group)
        if errors:
            raise errors[0]

    def _assign(self, shard_bytes: list[int], world: int) -> list[int]:
        """Writer rank of each shard: the least loaded so far (same answer on every rank)."""
        if len(self._bytes_written) != world:
            self._bytes_written = [0] * world
        writers = []
        for size in shard_bytes:
            rank = min(range(world), key=lambda r: (self._bytes_written[r], r))
            self._bytes_written[rank] += size
            writers.append(rank)
        return writers

    def _wait_for_path(self, key: str) -> None:
        future = self._pending_paths.pop(key, None)
        if future is not None:
            future.result()  # raises the earlier save's error here

    def has_pending(self) -> bool:
        """Whether async saves are still pending or unacknowledged."""
        return bool(self._pending)

    def close(self) -> None:
        """Finish pending work and stop the background threads."""
        for future in self._pending:
            future.result()
        self._pending = []
        self._executor.shutdown(wait=True)
        if self._writer is not None:
            self._writer.close()


def _plan(
    path: str,
    prefix: str,
    index_name: str,
    shards: list[list[str]],
    in_place: Mapping[str, Any] | None = None,
    extra_names: Collection[str] = (),
) -> dict[str, Any] | OSError | ValueError:
    """Rank 0's preparation: the directory, a fresh staging folder (none in place), the names.

    For an in-place save of the tensors ``in_place`` it also creates the files (their token
    in the plan: a rank that cannot see them fails the save); otherwise it leaves the token of
    the shared-directory check in the staging folder. ``root``: the outermost directory it
    created (see :func:`.inplace.missing_root`). Returns the error (extra files named like
    checkpoint files: ``ValueError``) instead of raising it, so that every rank can raise it;
    the directories it created are removed again then.
    """
    root = missing_root(path)
    try:
        created = prepare_directory(path)
        staging = staging_directory(path, prefix)
        durable.remove(staging)  # meta files of an interrupted save
        files = choose_file_names(path, index_name, prefix, len(shards))
        clash = sorted(set(extra_names) & {*files, index_name})
        if clash:
            raise ValueError(f"extra files {clash} would overwrite checkpoint files; rename them")
        shared = token = None
        if in_place is not None:  # the ranks meet in the temporary files, not in staging
            token = create_files(path, in_place, files, shards)
        else:
            os.makedirs(staging)
            shared = os.urandom(16).hex()
            with open(os.path.join(staging, _SHARED_CHECK), "w", encoding="ascii") as file:
                file.write(shared)
    except (OSError, ValueError) as err:
        remove_created(path, root)
        return err
    return {"created": created, "root": root, "files": files, "shared": shared, "token": token}


_SHARED_CHECK = ".shared-check"


def _check_shared_directory(
    path: str, plan: Mapping[str, Any], staging: str, rank: int, group: dist.ProcessGroup | None
) -> None:
    """Raise :class:`CheckpointError` on every rank unless all see rank 0's ``staging``.

    Ranks write their files into the directory rank 0 prepared and rank 0 waits for them, so
    a path that is not on a filesystem shared by the group would fail late (after a long
    wait). Rank 0 left a random token there before sharing its ``plan``; every rank reads it
    back. On failure rank 0 removes the staging folder, and ``path`` too if it created it and
    it is empty.
    """
    token_path = os.path.join(staging, _SHARED_CHECK)
    try:
        with open(token_path, encoding="ascii") as file:
            seen: str | None = file.read()
    except OSError:
        seen = None
    verdicts = all_gather_object(seen == plan["shared"], group)
    if rank == 0:
        os.remove(token_path)
    missing = [r for r, v in enumerate(verdicts) if not v]
    if missing:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            if plan["created"] and not os.listdir(path):
                os.rmdir(path)
        raise CheckpointError(
            f"ranks {missing} do not see {staging!r}, which rank 0 created: a checkpoint saved "
            "by several ranks needs a path on a filesystem shared by all of them (e.g. NFS or "
            "Lustre); pass such a path"
        )


def _identity(tensor: TensorLike, dst: int) -> torch.Tensor:
    """The default ``gather``: plain tensors are written as they are."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"a {type(tensor).__name__} (a sharded tensor) needs a gather function to be saved"
        )
    return tensor


class _Finalize:
    """Wait for a rank's files, record their metadata; rank 0 writes the index (the commit)."""

    def __init__(
        self,
        path: str,
        staging: str,
        prefix: str,
        index_name: str,
        index: dict[str, Any],
        handles: list[tuple[str, Any, dict[str, torch.Tensor] | None]],
        rank: int,
        world: int,
        texts: Mapping[str, str] | None = None,
    ) -> None:
        self.path, self.staging, self.prefix, self.index_name = path, staging, prefix, index_name
        self.index, self.handles, self.rank, self.world = index, handles, rank, world
        self.texts = dict(texts or {})

    def __call__(self) -> None:
        meta = {}
        for file, handle, tensors in self.handles:
            written = handle.wait()
            if isinstance(handle, Streamed):
                crc: str | None = handle.crc32
            else:
                crc = crc32_from_tensors(written, tensors) if tensors is not None else None
            meta[file] = {"size": os.path.getsize(written), "crc32": crc or file_crc32(written)}
        self.handles = []  # drop the tensors kept for the checksums
        durable.write_json(os.path.join(self.staging, f"rank{self.rank}.meta.json"), meta)
        if self.rank != 0:
            return
        files: dict[str, Any] = {}
        for r in range(self.world):
            files.update(_wait_for_json(os.path.join(self.staging, f"rank{r}.meta.json")))
        self.index["metadata"]["files"] = dict(sorted(files.items()))
        commit_index(self.path, self.index_name, self.index, self.prefix, self.texts)
        logger.info("%s checkpoint saved to %s", self.prefix, self.path)


def _wait_for_json(path: str, timeout: float = META_WAIT_SECONDS) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{path} did not appear within {timeout:.0f}s: a rank's part of the checkpoint "
                "was not written (did that rank fail?)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def run_on_rank0(fn: Callable[[], None], group: dist.ProcessGroup | None = None) -> None:
    """Run ``fn`` on rank 0 of ``group`` and let every rank wait for it (collective)."""
    rank, world = _rank_world(group)
    if rank == 0:
        fn()
    if world > 1:
        barrier(group)
