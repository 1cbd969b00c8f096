"""Communication helpers (tracked, with rank-naming errors), the comm tracker, and ``shm``.

The ``fp8_*`` helpers move float8 payloads (:mod:`colossal.core.comm.fp8`).

``shm`` is the shared-memory reduce-scatter / all-gather for groups whose ranks share a host.
"""

from colossal.core.comm import shm
from colossal.core.comm.errors import CommError
from colossal.core.comm.fp8 import (
    fp8_all_gather,
    fp8_all_reduce,
    fp8_all_to_all,
    fp8_recv,
    fp8_reduce_scatter,
    fp8_send,
)
from colossal.core.comm.fp8_codec import FP8_FORMATS, Fp8Codec
from colossal.core.comm.ops import (
    CommWork,
    P2POp,
    all_gather_object,
    all_reduce,
    all_to_all,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object,
    group_ranks,
    irecv,
    isend,
    recv,
    reduce,
    send,
)
from colossal.core.comm.sharded import ALGORITHMS, all_gather, reduce_scatter
from colossal.core.comm.tracker import CommRecord, CommStats, CommTracker

__all__ = [
    "ALGORITHMS",
    "CommError",
    "CommRecord",
    "CommStats",
    "CommTracker",
    "CommWork",
    "FP8_FORMATS",
    "Fp8Codec",
    "P2POp",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object",
    "fp8_all_gather",
    "fp8_all_reduce",
    "fp8_all_to_all",
    "fp8_recv",
    "fp8_reduce_scatter",
    "fp8_send",
    "group_ranks",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "shm",
]
