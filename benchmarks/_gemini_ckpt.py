"""Checkpoint save/load throughput of a Gemini model against the disk, for ``gemini.py``.

Runs inside the spawned ranks after the timed steps. Two things alternate in paired rounds:
the disk's write bandwidth (every rank writing its share with fsync, in parallel, as
``benchmarks/checkpoint.py``) and ``GeminiCheckpointIO``'s save (sharded, in place: every rank
writes its own flat ranges) and load of the model and the optimizer. Later rounds time a save
over an existing checkpoint and the previous save path (streamed through per-chunk gathers to
the rank writing each file): they write and delete twice the checkpoint's bytes, so they stay
out of the paired rounds, where they would leave writeback and freed extents to whichever
write came next. Each row is the median with min and max. Any failure becomes a row with the
error instead of ending the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from checkpoint import disk_write

logger = logging.getLogger(__name__)


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def _streamed_save(model: Any, optim: Any, root: str, nbytes: int) -> dict[str, Any]:
    """The previous save path: streamed through per-chunk gathers to each file's writer."""
    try:
        from colossal.booster.plugin.gemini_checkpoint_io import GeminiCheckpointIO

        io = GeminiCheckpointIO()
        io._in_place = lambda manager: False  # type: ignore[method-assign]
        seconds = _timed(
            lambda: (
                io.save_model(model, os.path.join(root, "model"), shard=True),
                io.save_optimizer(optim, os.path.join(root, "optim"), shard=True),
            )
        )
        return {"save_s": seconds, "GB": nbytes / 1e9} if nbytes else {"status": "skipped"}
    except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
        logger.warning("streamed gemini checkpoint failed: %r", exc)
        return {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}


ROUNDS = 7
EXTRA_ROUNDS = 3


def _probe(rank: int, world: int, here: str, nbytes: int) -> float:
    """Seconds for every rank to write its share of ``nbytes`` with fsync (the disk's speed).

    ``nbytes`` is the save's size once known, else the model states' (when the save failed).
    The file stays in ``here`` until the round is cleared, as the save's files do.
    """
    os.makedirs(here, exist_ok=True)
    return disk_write(os.path.join(here, f"disk{rank}.bin"), max(nbytes // world, 1 << 20),
                      keep=True)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def checkpoint_rows(
    rank: int, world: int, model: Any, optim: Any, psi: int, root: str, rounds: int = ROUNDS
) -> list[dict[str, Any]]:
    """Rows: disk write bandwidth, then Gemini save and load (model + optimizer) throughput.

    ``root`` is a directory every rank sees; it is emptied afterwards. The bytes counted for
    the Gemini rows are those the save wrote (read back from the directory). First ``rounds``
    paired rounds, each in a new directory: the disk write and our save follow each other
    directly, alternating which goes first (the second write meets the first one's
    writeback; measured at world 4, a save right after the probe took 0.42-0.53 s against
    0.22-0.25 s first), then the load reads the save back; then the round's files are
    deleted and the deletion settles (``os.sync``), untimed, so each round starts alike.
    Nothing else runs in these rounds. Each row is the median, with min and max; the save
    and load rows also carry the median over rounds of the probe's time over theirs in the
    same round (``*_vs_disk_paired``) and, in ``--json``, the per-round times
    (``rounds_s``). Then :data:`EXTRA_ROUNDS` rounds time the informational rows: a save
    over the round's checkpoint (which also deletes the replaced files inside the save) and
    the previous save path.
    """
    from colossal.booster.plugin.gemini_checkpoint_io import GeminiCheckpointIO

    io = GeminiCheckpointIO()
    times: dict[str, list[float]] = {k: [] for k in ("disk", "save", "load", "over", "streamed")}
    saved: dict[str, Any] = {}
    streamed: dict[str, Any] = {}
    nbytes = 0

    def save(here: str) -> None:
        io.save_model(model, os.path.join(here, "model"), shard=True)
        io.save_optimizer(optim, os.path.join(here, "optim"), shard=True)

    def load(here: str) -> None:
        io.load_model(model, os.path.join(here, "model"))
        io.load_optimizer(optim, os.path.join(here, "optim"))

    def clear(here: str) -> None:
        """Delete the round's files, then let the deletion settle (untimed) on every rank."""
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            shutil.rmtree(here, ignore_errors=True)
        os.sync()  # commits the frees: the next write does not meet blocks still being freed
        if dist.is_initialized():
            dist.barrier()

    for i in range(max(rounds, 1)):
        here = os.path.join(root, f"round{i}")
        # The two writes follow each other directly, in alternating order; the load comes
        # after both (a pause between them would let the disk catch up for the second).
        if i % 2:
            times["disk"].append(_probe(rank, world, here, nbytes or 3 * 4 * psi))
        if "status" not in saved:
            try:
                times["save"].append(_timed(lambda here=here: save(here)))
                nbytes = _dir_bytes(os.path.join(here, "model")) + _dir_bytes(
                    os.path.join(here, "optim"))
            except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
                logger.warning("gemini checkpoint failed: %r", exc)
                saved = {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}
        if not i % 2:
            times["disk"].append(_probe(rank, world, here, nbytes or 3 * 4 * psi))
        if "status" not in saved:
            try:
                times["load"].append(_timed(lambda here=here: load(here)))
            except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
                logger.warning("gemini checkpoint load failed: %r", exc)
                saved = {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}
        clear(here)
    for i in range(EXTRA_ROUNDS if "status" not in saved else 0):
        here = os.path.join(root, f"extra{i}")
        try:
            save(here)
            times["over"].append(_timed(lambda here=here: save(here)))
        except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
            logger.warning("gemini checkpoint over the previous one failed: %r", exc)
        if "status" not in streamed:
            streamed = _streamed_save(model, optim, os.path.join(here, "streamed"), nbytes)
            if "save_s" in streamed:
                times["streamed"].append(streamed.pop("save_s"))
        clear(here)
    probe = nbytes or 3 * 4 * psi
    gigabytes = nbytes / 1e9
    rows: list[dict[str, Any]] = [
        {"method": "disk write (fsync, all ranks)", "GB": probe / 1e9,
         **_spread("save", times["disk"])},
        {"method": "gemini save+load (model, optimizer)", "GB": gigabytes, **saved,
         **_spread("save", times["save"]), **_spread("load", times["load"])},
        {"method": "gemini save over the previous checkpoint (deletes it)", "GB": gigabytes,
         **saved, **_spread("save", times["over"])},
        {"method": "gemini save streamed through gathers (previous path)", "GB": gigabytes,
         **streamed, **_spread("save", times["streamed"])},
    ]
    # Paired: each round's probe against the same round's save and load (the disk's speed
    # drifts between rounds; a pair shares it).
    for kind in ("save", "load"):
        pairs = [d / t for d, t in zip(times["disk"], times[kind], strict=False) if t]
        if pairs and nbytes:
            rows[1][f"{kind}_vs_disk_paired"] = _median(pairs)
    rows[0]["rounds_s"] = times["disk"]  # per round, in order (kept in --json, not tabled)
    rows[1]["rounds_s"] = times["save"]
    for row in rows:
        if "save_s" in row:
            row["save_GB_s"] = row["GB"] / row["save_s"]
        if "load_s" in row:
            row["load_GB_s"] = row["GB"] / row["load_s"]
    return rows


def _spread(kind: str, values: list[float]) -> dict[str, float]:
    """``{kind}_s`` (median), ``{kind}_min_s`` and ``{kind}_max_s`` of ``values`` (if any)."""
    if not values:
        return {}
    return {f"{kind}_s": _median(values), f"{kind}_min_s": min(values),
            f"{kind}_max_s": max(values)}
