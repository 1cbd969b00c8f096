"""Seeds of MoE jobs: ``moe_set_seed`` (ColossalAI's ``colossalai.context.random``).

ColossalAI seeded each rank of a MoE model-parallel group differently so that the experts
held by different ranks start apart. Here the seed is a function of the *global expert
index* instead: ``Experts`` builds expert ``e`` under ``seed + e`` (:func:`expert_seed`), so
experts start apart on every rank, replicas of the same expert (its MoE data-parallel ranks)
start equal, and the model starts the same whatever the MoE size (one process included).
"""

from __future__ import annotations

import torch

__all__ = ["expert_seed", "moe_set_seed"]

_MOE_SEED: list[int] = []


def moe_set_seed(seed: int) -> None:
    """Seed the experts built afterwards: expert ``e`` is initialized under ``seed + e``.

    Call it on every rank before building the model (the seeds' ``moe_set_seed(42)``).

    Raises:
        TypeError: ``seed`` is not an int.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"moe_set_seed takes an int seed, got {seed!r}")
    _MOE_SEED[:] = [seed]


def expert_seed(expert_index: int) -> int:
    """The seed of global expert ``expert_index``: the MoE seed (else torch's) plus the index."""
    base = _MOE_SEED[0] if _MOE_SEED else torch.initial_seed()
    return (base + expert_index) % 2**63
