"""Gradient checkpointing of a chosen number of layers per pipeline stage.

``PipelineGradientCheckpointConfig`` says how many layers each stage (and model chunk)
recomputes in the backward, with ColossalAI's arguments: a ratio of each stage's layers, or
an explicit count per stage. ``apply_gradient_checkpointing`` (called by
``ShardFormer.optimize`` for every model chunk) switches it on for the first N layers the
chunk holds.

The layers are recomputed with transformers' own per-layer mechanism where the layer class
has it (5.x layers subclass ``GradientCheckpointingLayer``: the layer's ``forward`` runs
inside ``torch.utils.checkpoint``, module hooks stay outside), else the layer's forward is
wrapped on the instance (parameter names do not change). The recompute is non-reentrant
and replays the random state: the global CPU/accelerator RNG (``preserve_rng_state``) and the
private generators of this package's seeded tensor-parallel dropouts, so a layer with
dropout computes the same masks twice and the gradients equal a run without checkpointing.
A key/value cache passed to a checkpointed layer is dropped (the recompute would write it a
second time), as transformers does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from colossal.shardformer.shard.stack import find_layer_stack

if TYPE_CHECKING:
    from colossal.shardformer.layer.dropout import _SeededDropout
    from colossal.shardformer.shard.config import ShardConfig

__all__ = ["PipelineGradientCheckpointConfig", "apply_gradient_checkpointing"]

logger = logging.getLogger(__name__)

_EPS = 1e-9  # ratio * layers is floored; 0.29 * 100 is 28.999999999999996 in floats
_MARK = "_colossal_grad_ckpt"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"PipelineGradientCheckpointConfig.{name} must be a list of ints, got {value!r}"
        )
    counts = tuple(value)
    if not counts or any(not _is_int(c) or c < 0 for c in counts):
        raise ValueError(
            f"PipelineGradientCheckpointConfig.{name} must be a non-empty list of ints >= 0 "
            f"(one per stage and model chunk), got {list(counts)}"
        )
    return counts


@dataclass(frozen=True)
class PipelineGradientCheckpointConfig:
    """How many layers each pipeline stage recomputes in the backward (ColossalAI's API).

    Give either ``gradient_checkpointing_ratio`` (the fraction of each stage's layers,
    rounded down) or ``num_ckpt_layers_per_stage`` (an explicit count per stage and model
    chunk, which takes precedence over the ratio). Lists are indexed by ``stage + chunk *
    num_stages`` (chunk ``c`` of stage ``s``; with one chunk simply the stage). The optional
    sizes are checked against each other and against the pipeline the config is used with.
    Without pipeline parallelism the model is stage 0 of 1.

    Example::

        # 4 stages of 4 layers: recompute 3, 2, 1 and 0 layers
        PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[3, 2, 1, 0])
        # half of every stage's layers
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)

    Attributes:
        gradient_checkpointing_ratio: Fraction in ``[0, 1]`` of a stage's layers to recompute
            (``floor(ratio * layers)``).
        num_ckpt_layers_per_stage: Layers to recompute per stage and chunk
            (``num_stages * num_model_chunks`` ints >= 0).
        num_stages: Pipeline stages (optional; checked against the pipeline).
        num_model_chunks: Model chunks per stage (optional; checked against the pipeline).
        num_model_layers: Layers of the whole model (optional; lets the ratio be computed
            without the stage's own count: ``num_model_layers // (stages * chunks)``).
        num_layers_per_stage: Layers of each stage and chunk (optional; the ratio's base).

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: Neither the ratio nor the counts, a ratio outside ``[0, 1]``, or sizes that
            contradict each other (the message names them).
    """

    gradient_checkpointing_ratio: float | None = None
    num_ckpt_layers_per_stage: Sequence[int] | None = None
    num_stages: int | None = None
    num_model_chunks: int | None = None
    num_model_layers: int | None = None
    num_layers_per_stage: Sequence[int] | None = None

    def __post_init__(self) -> None:
        ratio = self.gradient_checkpointing_ratio
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
                raise TypeError(
                    "PipelineGradientCheckpointConfig.gradient_checkpointing_ratio must be a "
                    f"number in [0, 1], got {ratio!r}"
                )
            if not 0.0 <= float(ratio) <= 1.0:
                raise ValueError(
                    "PipelineGradientCheckpointConfig.gradient_checkpointing_ratio must lie in "
                    f"[0, 1] (a fraction of each stage's layers), got {ratio!r}"
                )
            object.__setattr__(self, "gradient_checkpointing_ratio", float(ratio))
        for name in ("num_stages", "num_model_chunks", "num_model_layers"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(
                    f"PipelineGradientCheckpointConfig.{name} must be an int >= 1 or None, got "
                    f"{value!r}"
                )
        ckpt = _check_counts("num_ckpt_layers_per_stage", self.num_ckpt_layers_per_stage)
        layers = _check_counts("num_layers_per_stage", self.num_layers_per_stage)
        object.__setattr__(self, "num_ckpt_layers_per_stage", ckpt)
        object.__setattr__(self, "num_layers_per_stage", layers)
        if ratio is None and ckpt is None:
            raise ValueError(
                "PipelineGradientCheckpointConfig needs gradient_checkpointing_ratio (a fraction "
                "of each stage's layers) or num_ckpt_layers_per_stage (a count per stage)"
            )
        self._check_sizes(ckpt, layers)

    def _check_sizes(self, ckpt: tuple[int, ...] | None, layers: tuple[int, ...] | None) -> None:
        slices = None
        if self.num_stages is not None and self.num_model_chunks is not None:
            slices = self.num_stages * self.num_model_chunks
        for name, counts in (("num_ckpt_layers_per_stage", ckpt), ("num_layers_per_stage", layers)):
            if counts is not None and slices is not None and len(counts) != slices:
                raise ValueError(
                    f"PipelineGradientCheckpointConfig.{name} has {len(counts)} entries; "
                    f"num_stages={self.num_stages} x num_model_chunks={self.num_model_chunks} "
                    f"needs {slices}"
                )
        total = self.num_model_layers
        if layers is not None and total is not None and sum(layers) != total:
            raise ValueError(
                f"PipelineGradientCheckpointConfig.num_layers_per_stage={list(layers)} sums to "
                f"{sum(layers)}, not num_model_layers={total}"
            )
        if ckpt is not None and total is not None and sum(ckpt) > total:
            raise ValueError(
                f"PipelineGradientCheckpointConfig.num_ckpt_layers_per_stage={list(ckpt)} "
                f"recomputes {sum(ckpt)} layers, more than num_model_layers={total}"
            )
        if ckpt is not None and layers is not None:
            if len(ckpt) != len(layers):
                raise ValueError(
                    f"num_ckpt_layers_per_stage={list(ckpt)} and num_layers_per_stage="
                    f"{list(layers)} must have the same length (one entry per stage and chunk)"
                )
            over = [i for i, (c, n) in enumerate(zip(ckpt, layers, strict=True)) if c > n]
            if over:
                raise ValueError(
                    f"num_ckpt_layers_per_stage={list(ckpt)} exceeds num_layers_per_stage="
                    f"{list(layers)} at entries {over}: a stage cannot recompute more layers "
                    "than it holds"
                )

    def get_num_ckpt_layers(
        self,
        stage: int,
        num_stages: int,
        num_model_chunks: int,
        model_chunk_id: int = 0,
        num_layers: int | None = None,
    ) -> int:
        """Layers model chunk ``model_chunk_id`` of ``stage`` recomputes.

        Args:
            stage: This pipeline stage (0-based).
            num_stages: Pipeline stages.
            num_model_chunks: Model chunks per stage.
            model_chunk_id: The chunk (0-based).
            num_layers: Layers this chunk holds; the ratio's base when given (else
                ``num_layers_per_stage`` or ``num_model_layers // (stages * chunks)``).

        Returns:
            ``num_ckpt_layers_per_stage[stage + model_chunk_id * num_stages]`` when the counts
            are given, else ``floor(ratio * layers)``.

        Raises:
            ValueError: A stage or chunk out of range, a pipeline shape other than the
                config's, or a ratio without any layer count.
        """
        for name, value, bound in (
            ("num_stages", num_stages, None),
            ("num_model_chunks", num_model_chunks, None),
            ("stage", stage, num_stages),
            ("model_chunk_id", model_chunk_id, num_model_chunks),
        ):
            low = 0 if bound is not None else 1
            if not _is_int(value) or value < low or (bound is not None and value >= bound):
                limit = f" < {bound}" if bound is not None else ""
                raise ValueError(
                    f"get_num_ckpt_layers: {name} must be an int >= {low}{limit}, got {value!r}"
                )
        for name, mine, given in (
            ("num_stages", self.num_stages, num_stages),
            ("num_model_chunks", self.num_model_chunks, num_model_chunks),
        ):
            if mine is not None and mine != given:
                raise ValueError(
                    f"PipelineGradientCheckpointConfig was made for {name}={mine} but the "
                    f"pipeline has {given}; fix the config's {name}"
                )
        index = stage + model_chunk_id * num_stages
        slices = num_stages * num_model_chunks
        if self.num_ckpt_layers_per_stage is not None:
            counts = self.num_ckpt_layers_per_stage
            if len(counts) != slices:
                raise ValueError(
                    f"num_ckpt_layers_per_stage={list(counts)} has {len(counts)} entries, the "
                    f"pipeline has {num_stages} stages x {num_model_chunks} chunks = {slices}"
                )
            return counts[index]
        if num_layers is not None:
            base = num_layers
        elif self.num_layers_per_stage is not None:
            if len(self.num_layers_per_stage) != slices:
                raise ValueError(
                    f"num_layers_per_stage={list(self.num_layers_per_stage)} has "
                    f"{len(self.num_layers_per_stage)} entries, the pipeline has {slices} slices"
                )
            base = self.num_layers_per_stage[index]
        elif self.num_model_layers is not None:
            base = self.num_model_layers // slices
        else:
            raise ValueError(
                "gradient_checkpointing_ratio needs a layer count: pass num_layers, or give the "
                "config num_model_layers or num_layers_per_stage"
            )
        ratio = self.gradient_checkpointing_ratio
        assert ratio is not None  # __post_init__: a ratio or num_ckpt_layers_per_stage
        return math.floor(ratio * base + _EPS)


# ---------------------------------------------------------------------------------------------
# The recompute.


def _seeded_dropouts(layer: nn.Module) -> list[_SeededDropout]:
    from colossal.shardformer.layer.dropout import _SeededDropout

    return [m for m in layer.modules() if isinstance(m, _SeededDropout)]


def _generator_states(dropouts: list[_SeededDropout]) -> list[dict[Any, torch.Tensor]]:
    return [{dev: gen.get_state() for dev, gen in d._generators.items()} for d in dropouts]


def _set_generator_states(
    dropouts: list[_SeededDropout], states: list[dict[Any, torch.Tensor]]
) -> None:
    for module, saved in zip(dropouts, states, strict=True):
        for dev, gen in module._generators.items():
            if dev in saved:
                gen.set_state(saved[dev])
            else:  # made during the first run: it started from the seed
                gen.manual_seed(module.seed)


@contextlib.contextmanager
def _replay(
    dropouts: list[_SeededDropout], states: list[dict[Any, torch.Tensor]]
) -> Iterator[None]:
    """Run with the dropouts' generators as they were before the first run, then put back."""
    now = _generator_states(dropouts)
    _set_generator_states(dropouts, states)
    try:
        yield
    finally:
        _set_generator_states(dropouts, now)


def _drop_caches(layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if getattr(layer, "_can_checkpoint_with_cache", False):
        return args
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a dependency
        return args
    return tuple(None if isinstance(a, Cache) else a for a in args)


def _checkpoint_layer(layer: nn.Module, function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` (one layer's forward) under non-reentrant checkpointing.

    Matches transformers' ``_gradient_checkpointing_func(function, *args)`` signature.
    """
    args = _drop_caches(layer, args)
    dropouts = [d for d in _seeded_dropouts(layer) if d.training and d.p > 0.0]
    if not dropouts:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True)
    states = _generator_states(dropouts)
    first = [True]

    def run(*inner: Any) -> Any:
        if first[0]:
            first[0] = False
            return function(*inner)
        with _replay(dropouts, states):
            return function(*inner)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


class _CheckpointedForward:
    """An instance-level ``forward`` recomputing a layer class without transformers' hook."""

    def __init__(self, layer: nn.Module, inner: Callable[..., Any], bound: bool) -> None:
        self.layer, self.inner, self.bound = layer, inner, bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.inner if self.bound else functools.partial(self.inner, self.layer)
        if self.layer.training and torch.is_grad_enabled():
            return _checkpoint_layer(self.layer, functools.partial(call, **kwargs), *args)
        return call(*args, **kwargs)


def _enable(layer: nn.Module) -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    if getattr(layer, _MARK, False):
        return
    if isinstance(layer, GradientCheckpointingLayer):
        layer._gradient_checkpointing_func = functools.partial(_checkpoint_layer, layer)  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module
        layer.gradient_checkpointing = True
    else:
        own = layer.__dict__.get("forward")
        if own is not None:
            layer.forward = _CheckpointedForward(layer, own, bound=True)
        else:
            layer.forward = _CheckpointedForward(layer, type(layer).forward, bound=False)
    setattr(layer, _MARK, True)


def apply_gradient_checkpointing(
    model: nn.Module, config: ShardConfig, chunk_id: int = 0
) -> None:
    """Recompute the first N layers ``model`` (one pipeline chunk) holds in the backward.

    N is ``config.gradient_checkpoint_config.get_num_ckpt_layers(stage, num_stages,
    num_model_chunks, chunk_id)`` with the stage from ``config.pipeline_stage_manager`` (stage
    0 of 1 without one). Recomputation only happens in training mode with autograd on.

    Args:
        model: The model or pipeline chunk (its layer stack is found with
            :func:`~colossal.shardformer.shard.stack.find_layer_stack`).
        config: The ``ShardConfig``.
        chunk_id: The model chunk of this stage ``model`` is.

    Raises:
        ValueError: N is not an int in ``[0, layers held]`` (the message names both).
    """
    ckpt = config.gradient_checkpoint_config
    if ckpt is None:
        return
    manager = config.pipeline_stage_manager
    if manager is None:
        stage, num_stages, num_chunks = 0, 1, 1
    else:
        stage, num_stages = int(manager.stage), int(manager.num_stages)
        num_chunks = int(manager.num_model_chunks)
    path, stack = find_layer_stack(model)
    held = list(stack)
    if isinstance(ckpt, PipelineGradientCheckpointConfig):
        n = ckpt.get_num_ckpt_layers(stage, num_stages, num_chunks, chunk_id, num_layers=len(held))
    else:
        n = ckpt.get_num_ckpt_layers(stage, num_stages, num_chunks, chunk_id)
    if not _is_int(n) or n < 0:
        raise ValueError(
            f"gradient_checkpoint_config.get_num_ckpt_layers returned {n!r} for stage {stage} "
            f"chunk {chunk_id}; it must be an int >= 0"
        )
    if n > len(held):
        raise ValueError(
            f"gradient_checkpoint_config asks stage {stage} chunk {chunk_id} to recompute {n} "
            f"layers, but it holds {len(held)} ({path}); lower num_ckpt_layers_per_stage or the "
            "ratio"
        )
    for layer in held[:n]:
        _enable(layer)
    logger.info(
        "gradient checkpointing: stage %d chunk %d recomputes %d of its %d layers (%s)",
        stage,
        chunk_id,
        n,
        len(held),
        path,
    )
