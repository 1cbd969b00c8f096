"""Process groups live until the process exits, so tearing them down can never deadlock.

Why: a gloo worker thread that finishes a collective frees the work while holding the group's
queue lock. A barrier keeps the works issued before it allocated until it is itself freed, so
that free can release tensors that Python created and already dropped; releasing their Python
objects needs the GIL. If the main thread (holding the GIL) drops the last reference to the
group at that moment, for example when a DDP model or an optimizer is freed after
``destroy_process_group()``, the group's destructor waits for the queue lock while the worker
waits for the GIL: both wait forever. Whether it happens depends on thread timing, so any
script that ends with ``barrier(); destroy_process_group()`` can hang at random.

The only ordering that rules it out is one where the native group is never destroyed while
Python runs. :func:`keep_alive` takes one extra reference to a group that is never given back:
``destroy_process_group()`` still unregisters and shuts the group down, but its native object,
worker threads and sockets are released by the operating system when the process exits, after
the interpreter has finished. Colossal keeps alive every group it creates or is handed
(:func:`colossal.core.launch`, :class:`colossal.core.ProcessGroupMesh`, the plugins' and
optimizers' groups), and :func:`colossal.core.destroy` keeps alive every group that still
exists before destroying them. The cost: a process that creates and destroys groups many times
keeps each group's worker threads and connections until it exits.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import TypeVar

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["keep_alive", "keep_all_alive", "kept_alive_count"]

G = TypeVar("G")

_kept_ids: set[int] = set()  # ids of kept groups; never reused, since kept objects never die


def keep_alive(group: G) -> G:
    """Keep ``group``'s native object alive until the process exits; returns ``group``.

    ``None`` (the default group, resolved by torch) and non-members are returned unchanged.
    Calling it again for the same group does nothing.

    Args:
        group: A ``torch.distributed.ProcessGroup``, or ``None``.

    Returns:
        ``group`` itself, so that it can wrap an expression.
    """
    if group is None or not dist.is_available():
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER or id(group) in _kept_ids:
        return group
    # One reference that nothing gives back: the object survives interpreter shutdown too
    # (a module-level list would be cleared then, and its destructor could hang there).
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _kept_ids.add(id(group))
    return group


def keep_all_alive() -> int:
    """Keep alive every process group torch.distributed currently knows; returns how many."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    groups = list(dist.distributed_c10d._world.pg_map)  # every live group, the default included
    for group in groups:
        keep_alive(group)
    return len(groups)


WORKER_DRAIN_SECONDS = 0.2
"""How long :func:`let_workers_finish` gives the groups' worker threads to free their work."""


def let_workers_finish(seconds: float | None = None) -> None:
    """Release the GIL for a moment so gloo worker threads can free their finished work.

    A collective issued during ``backward()`` (DDP's gradient all-reduce, a tensor-parallel
    layer's input-gradient all-reduce) captures the thread-local state, which holds a Python
    object (the ``contextvars`` context autograd stashes for the backward). The gloo worker
    thread that ran it frees it after the collective has completed, and dropping that object
    takes the GIL. If the interpreter is already finalizing by then, the worker's ``take_gil``
    exits the thread inside a ``noexcept`` destructor and the process dies with ``terminate
    called without an active exception`` (seen in 5 of 20 runs of a 2-rank DDP script that
    ends right after its last step). Sleeping here, with the GIL released, lets the workers
    finish that free before the interpreter starts shutting down.

    Args:
        seconds: How long (default :data:`WORKER_DRAIN_SECONDS`, read at call time).
    """
    seconds = WORKER_DRAIN_SECONDS if seconds is None else seconds
    if seconds > 0:
        time.sleep(seconds)


def kept_alive_count() -> int:
    """How many groups this process keeps alive (for tests and diagnostics)."""
    return len(_kept_ids)
