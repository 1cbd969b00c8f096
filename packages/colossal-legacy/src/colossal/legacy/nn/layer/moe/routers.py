"""ColossalAI's routers and noise, accepting the early ``capacity_factor=`` argument too."""

from __future__ import annotations

from collections.abc import Callable

import torch

from colossal.shardformer.moe import NormalNoiseGenerator, UniformNoiseGenerator
from colossal.shardformer.moe import Top1Router as _Top1Router
from colossal.shardformer.moe import Top2Router as _Top2Router

__all__ = ["NormalNoiseGenerator", "Top1Router", "Top2Router", "UniformNoiseGenerator"]

Noise = Callable[[torch.Tensor], torch.Tensor]


def _factors(
    train: float | None, eval_: float | None, capacity_factor: float | None
) -> tuple[float | None, float | None]:
    """``capacity_factor`` (ColossalAI 0.1's one factor) sets both modes' factors."""
    if capacity_factor is None:
        return train, eval_
    if not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
    return float(capacity_factor), float(capacity_factor)


class Top1Router(_Top1Router):
    """Switch-style top-1 router (see :class:`colossal.shardformer.moe.Top1Router`).

    ``capacity_factor=`` (the seeds' era) sets the train and eval factors at once; a
    factor of None routes dropless.
    """

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        select_policy: str = "first",
        noisy_func: Noise | None = None,
        drop_tks: bool = True,
        capacity_factor: float | None = None,
    ) -> None:
        train, eval_ = _factors(capacity_factor_train, capacity_factor_eval, capacity_factor)
        super().__init__(train, eval_, min_capacity, select_policy, noisy_func, drop_tks)


class Top2Router(_Top2Router):
    """GShard-style top-2 router (see :class:`colossal.shardformer.moe.Top2Router`).

    The seeds' ``Top2Router(capacity_factor, noisy_func=...)``: the first argument is the
    training factor; ``capacity_factor=`` sets both modes' factors.
    """

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        noisy_func: Noise | None = None,
        drop_tks: bool = True,
        capacity_factor: float | None = None,
    ) -> None:
        train, eval_ = _factors(capacity_factor_train, capacity_factor_eval, capacity_factor)
        super().__init__(train, eval_, min_capacity, noisy_func, drop_tks)
