"""Checkpoint save/load throughput of a Gemini model against the disk, for ``gemini.py``.

Runs inside the spawned ranks after the timed steps. Two things alternate in paired rounds:
the disk's write bandwidth (every rank writing its share with fsync, in parallel, as
``benchmarks/checkpoint.py``) and ``GeminiCheckpointIO``'s save (sharded, in place: every rank
writes its own flat ranges) and load of the model and the optimizer.

Where a write lands decides its speed on these machines' virtual disks: 600 MB written at
world 4 into blocks a deleted file has just freed took 0.24-0.29 s, into blocks never
written before 0.80-1.07 s, whatever the writer (a plain ``write`` + ``fsync`` and our save
alike, and still after 12 s of rest). A second write after the first one, both kept, lands on
fresh blocks and loses 3x; paired rounds that ran back to back timed the block allocator,
not the writer. So every measured write here starts alike: its directory is the same
persistent one, the previous write's files were deleted and the deletion synced (untimed),
and :data:`WARMUP_ROUNDS` untimed rounds of both came first. Later rounds time a save over
an existing checkpoint and the previous save path (streamed through per-chunk gathers to the
rank writing each file). Each row is the median with min and max. Any failure becomes a row
with the error instead of ending the run.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from bench_common import paired_median, spread
from checkpoint import clear_directory, disk_write, evict_from_cache, timed

logger = logging.getLogger(__name__)


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def _streamed_save(model: Any, optim: Any, root: str, nbytes: int) -> dict[str, Any]:
    """The previous save path: streamed through per-chunk gathers to each file's writer."""
    try:
        from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO

        io = GeminiCheckpointIO()
        io._in_place = lambda manager: False  # type: ignore[method-assign]
        seconds = timed(
            lambda: (
                io.save_model(model, os.path.join(root, "model"), shard=True),
                io.save_optimizer(optim, os.path.join(root, "optim"), shard=True),
            )
        )
        return {"save_s": seconds, "GB": nbytes / 1e9} if nbytes else {"status": "skipped"}
    except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
        logger.warning("streamed gemini checkpoint failed: %r", exc)
        return {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}


ROUNDS = 11
WARMUP_ROUNDS = 2
EXTRA_ROUNDS = 3


def _probe(rank: int, world: int, here: str, nbytes: int) -> float:
    """Seconds for every rank to write its share of ``nbytes`` with fsync (the disk's speed).

    ``nbytes`` is the save's size once known, else the model states' (when the save failed).
    The file stays in ``here`` until it is cleared (``checkpoint.clear_directory``), as the
    save's files do.
    """
    os.makedirs(here, exist_ok=True)
    return disk_write(os.path.join(here, f"disk{rank}.bin"), max(nbytes // world, 1 << 20),
                      keep=True)


def checkpoint_rows(
    rank: int, world: int, model: Any, optim: Any, psi: int, root: str, rounds: int = ROUNDS
) -> list[dict[str, Any]]:
    """Rows: disk write bandwidth, then Gemini save and load (model + optimizer) throughput.

    ``root`` is a directory every rank sees; it is emptied afterwards. The bytes counted for
    the Gemini rows are those the save wrote (read back from the directory). Untimed
    warm-up rounds (:data:`WARMUP_ROUNDS`) come first; then ``rounds`` paired rounds, the
    probe and our save in alternating order, the load right after the save (from the disk:
    the files are dropped from the page cache first), each write's
    files deleted and the deletion synced before the next write (so each write reuses freed
    blocks; see the module's docstring). Each row is the median, with min and max; the save
    and load rows also carry the median over rounds of the probe's time over theirs in the
    same round (``*_vs_disk_paired``) and, in ``--json``, the per-round times
    (``rounds_s``). Then :data:`EXTRA_ROUNDS` rounds time the informational rows: a save
    over an existing checkpoint (which also deletes the replaced files inside the save) and
    the previous save path.
    """
    from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO

    io = GeminiCheckpointIO()
    times: dict[str, list[float]] = {k: [] for k in ("disk", "save", "load", "over", "streamed")}
    saved: dict[str, Any] = {}
    streamed: dict[str, Any] = {}
    here = os.path.join(root, "work")
    os.makedirs(here, exist_ok=True)
    nbytes = 0

    def save() -> None:
        io.save_model(model, os.path.join(here, "model"), shard=True)
        io.save_optimizer(optim, os.path.join(here, "optim"), shard=True)

    def load() -> None:
        io.load_model(model, os.path.join(here, "model"))
        io.load_optimizer(optim, os.path.join(here, "optim"))

    def save_and_load(counted: bool) -> None:
        """Our save, then the load of what it wrote; a failure ends both for the run."""
        nonlocal nbytes, saved
        try:
            seconds = timed(save)
            nbytes = _dir_bytes(os.path.join(here, "model")) + _dir_bytes(
                os.path.join(here, "optim"))
            if counted:
                times["save"].append(seconds)
        except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
            logger.warning("gemini checkpoint failed: %r", exc)
            saved = {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}
            return
        evict_from_cache(rank, here)  # the load reads the disk, as after a restart
        try:
            seconds = timed(load)
            if counted:
                times["load"].append(seconds)
        except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
            logger.warning("gemini checkpoint load failed: %r", exc)
            saved = {"status": f"failed: {type(exc).__name__}: {str(exc)[:120]}"}

    def probe(counted: bool) -> None:
        seconds = _probe(rank, world, here, nbytes or 3 * 4 * psi)
        if counted:
            times["disk"].append(seconds)

    steps = [(save_and_load, False), (probe, False)] * WARMUP_ROUNDS
    for i in range(max(rounds, 1)):
        pair = [(save_and_load, True), (probe, True)]
        steps += pair[::-1] if i % 2 else pair
    for step, counted in steps:
        if step is probe or "status" not in saved:
            step(counted)
        clear_directory(rank, here)
    for _ in range(EXTRA_ROUNDS if "status" not in saved else 0):
        try:
            save()
            times["over"].append(timed(save))
        except Exception as exc:  # noqa: BLE001 - the section is reported, the run goes on
            logger.warning("gemini checkpoint over the previous one failed: %r", exc)
        clear_directory(rank, here)
        if "status" not in streamed:
            streamed = _streamed_save(model, optim, os.path.join(here, "streamed"), nbytes)
            if "save_s" in streamed:
                times["streamed"].append(streamed.pop("save_s"))
        clear_directory(rank, here)
    probe = nbytes or 3 * 4 * psi
    gigabytes = nbytes / 1e9
    rows: list[dict[str, Any]] = [
        {"method": "disk write (fsync, all ranks)", "GB": probe / 1e9,
         **spread("save", times["disk"])},
        {"method": "gemini save+load (model, optimizer)", "GB": gigabytes, **saved,
         **spread("save", times["save"]), **spread("load", times["load"])},
        {"method": "gemini save over the previous checkpoint (deletes it)", "GB": gigabytes,
         **saved, **spread("save", times["over"])},
        {"method": "gemini save streamed through gathers (previous path)", "GB": gigabytes,
         **streamed, **spread("save", times["streamed"])},
    ]
    # Paired: each round's probe against the same round's save and load (the disk's speed
    # drifts between rounds; a pair shares it).
    for kind in ("save", "load"):
        if times[kind] and nbytes:
            rows[1][f"{kind}_vs_disk_paired"] = paired_median(times["disk"], times[kind])
    rows[0]["rounds_s"] = times["disk"]  # per round, in order (kept in --json, not tabled)
    rows[1]["rounds_s"] = times["save"]
    for row in rows:
        if "save_s" in row:
            row["save_GB_s"] = row["GB"] / row["save_s"]
        if "load_s" in row:
            row["load_GB_s"] = row["GB"] / row["load_s"]
    return rows

