"""ColossalAI's HybridParallelPlugin options that tune its own machinery: what they mean here.

* ``overlap_p2p``: ColossalAI posts a pipeline stage's sends and receives asynchronously
  when True (its default). colossal-pipeline always does (``PipelineP2P`` posts every
  transfer of a step at once and waits only when the data is used), so True is what runs;
  False is accepted and warns once: the transfers still overlap (the results are the same).
* ``overlap_allgather``: ZeRO's parameter all-gather after a step overlaps the next forward;
  passed to ``LowLevelZeroOptimizer(overlap_allgather=)`` (see there).
* ``scheduler_nodes``: the ZB-V node list ColossalAI builds with ``PipelineGraph``; with
  ``pp_style="zbv"`` our ``ZeroBubbleVPipeScheduler`` runs its order (``schedule=``), and
  the other schedules, which have no use for it, refuse it.
* ``inner_ring_size``: the inner ring of ColossalAI's double-ring attention
  (``sequence_parallelism_mode="ring_attn"``). Our ring attention runs one ring over the
  sequence-parallel group: the same blocks meet, only the links differ, so the attention is
  the same. It must divide ``sp_size``; without ``ring_attn`` it is ignored, as in ColossalAI.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from colossal.booster.plugin.hybrid.config import HybridConfig
from colossal.core import warn_once

__all__ = ["check_colossalai_options"]


def check_colossalai_options(
    config: HybridConfig,
    logger: logging.Logger,
    *,
    overlap_p2p: bool,
    overlap_allgather: bool,
    scheduler_nodes: Sequence[object] | None,
    inner_ring_size: int | None,
) -> None:
    """Validate ColossalAI's tuning options against the layout; warn where one has no effect.

    Raises:
        TypeError: A flag that is not a bool, ``scheduler_nodes`` that is not a list.
        ValueError: ``scheduler_nodes`` without ``pp_style="zbv"``, or an
            ``inner_ring_size`` that does not divide ``sp_size`` under ``ring_attn``.
    """
    for name, flag in (("overlap_p2p", overlap_p2p), ("overlap_allgather", overlap_allgather)):
        if not isinstance(flag, bool):
            raise TypeError(f"HybridParallelPlugin: {name}={flag!r} must be True or False")
    if not overlap_p2p:
        warn_once(
            logger,
            "HybridParallelPlugin(overlap_p2p=False) has no effect: colossal-pipeline always "
            "posts a step's transfers asynchronously (the results are the same)",
        )
    if scheduler_nodes is not None:
        if isinstance(scheduler_nodes, (str, bytes)) or not isinstance(scheduler_nodes, Sequence):
            raise TypeError(
                "HybridParallelPlugin: scheduler_nodes must be the list of scheduled nodes "
                f"(PipelineGraph(...).get_v_schedule()), got {type(scheduler_nodes).__name__}"
            )
        if config.pp_style != "zbv":
            raise ValueError(
                f"HybridParallelPlugin: scheduler_nodes is for pp_style='zbv' (got "
                f"pp_style={config.pp_style!r}); drop it or use pp_style='zbv'"
            )
    _check_inner_ring(config, inner_ring_size)


def _check_inner_ring(config: HybridConfig, inner_ring_size: int | None) -> None:
    if inner_ring_size is None:
        return
    if isinstance(inner_ring_size, bool) or not isinstance(inner_ring_size, int):
        raise TypeError(
            f"HybridParallelPlugin: inner_ring_size={inner_ring_size!r} must be an int or None"
        )
    if config.sequence_parallelism_mode != "ring_attn":
        return  # ColossalAI reads it only for ring attention
    sp = config.resolved_sp_size
    if inner_ring_size < 1 or sp % inner_ring_size:
        raise ValueError(
            f"HybridParallelPlugin: inner_ring_size={inner_ring_size} must divide "
            f"sp_size={sp} (the double ring's inner ring); leave it None"
        )
