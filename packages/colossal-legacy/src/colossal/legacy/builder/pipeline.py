"""build_pipeline_model(_from_cfg): this stage's slice of a sequential model.

The seeds' builders ("Pipeline Parallel", "Train ViT Using Pipeline Parallelism"): a model
written as a flat sequence of layers is split over the pipeline stages of ``gpc`` and each
rank keeps its slice(s). Layer names are kept, so a stage's ``state_dict`` keys are those of
the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Literal

from torch import nn

from colossal.lazy import LazyInitContext
from colossal.legacy.builder.partition import Parts, partition_balanced, partition_uniform
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.registry import LAYERS, MODELS

__all__ = ["build_layer", "build_pipeline_model", "build_pipeline_model_from_cfg", "stage_rank"]

logger = logging.getLogger(__name__)


def stage_rank() -> tuple[int, int]:
    """``(stage, stages)`` of this rank in ``gpc`` (``(0, 1)`` without a pipeline)."""
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        return 0, 1
    return gpc.get_local_rank(ParallelMode.PIPELINE), gpc.get_world_size(ParallelMode.PIPELINE)


def _slices(layers: nn.Sequential, parts: list[tuple[int, int]]) -> nn.Module:
    chunks = [layers[start:end] for start, end in parts]
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)


def build_pipeline_model(
    layers: nn.Sequential, num_chunks: int = 1, verbose: bool = False
) -> nn.Module:
    """This stage's layers of ``layers``, split uniformly by layer count.

    Args:
        layers: The whole model as an ``nn.Sequential``.
        num_chunks: Model chunks per stage (more than 1 for the interleaved schedule).
        verbose: Log each rank's slice.

    Returns:
        An ``nn.Sequential`` (one chunk) or an ``nn.ModuleList`` of them.

    Raises:
        TypeError: ``layers`` is not an ``nn.Sequential``.
    """
    if not isinstance(layers, nn.Sequential):
        raise TypeError(
            f"build_pipeline_model splits an nn.Sequential, got {type(layers).__name__}; "
            "write the model as nn.Sequential(layer, ...) or use PipelinableContext"
        )
    stage, stages = stage_rank()
    parts = partition_uniform(len(layers), stages, num_chunks)[stage]
    if verbose:
        logger.info("pipeline stage %d/%d holds layers %s of %d", stage, stages, parts, len(layers))
    return _slices(layers, parts)


def build_layer(config: Mapping[str, object]) -> nn.Module:
    """A module from ``dict(type=name, **kwargs)``: ``LAYERS``, ``MODELS``, then ``torch.nn``.

    Raises:
        ValueError: No ``type``, or the type is found nowhere.
    """
    if "type" not in config:
        raise ValueError(f"layer config {dict(config)!r} needs a 'type'")
    name = str(config["type"])
    kwargs = {k: v for k, v in config.items() if k != "type"}
    for registry in (LAYERS, MODELS):
        if registry.has(name):
            return registry.get_module(name)(**kwargs)  # type: ignore[operator]
    factory = getattr(nn, name, None)
    if not (isinstance(factory, type) and issubclass(factory, nn.Module)):
        raise ValueError(
            f"layer type {name!r} is neither registered (LAYERS, MODELS) nor a torch.nn "
            "module; decorate your class with @LAYERS.register_module"
        )
    return factory(**kwargs)


def _layer_configs(config: Mapping[str, object]) -> Sequence[Mapping[str, object]]:
    if "layers" in config:
        layers = config["layers"]
    else:
        model = build_layer(config)
        layers = getattr(model, "layers_cfg", None)
        if layers is None:
            raise ValueError(
                f"model {config.get('type')!r} has no layers_cfg; give the config a 'layers' "
                "list of layer configs instead"
            )
    if not isinstance(layers, Sequence) or not all(isinstance(c, Mapping) for c in layers):
        raise ValueError(f"'layers' must be a list of layer configs (dicts), got {layers!r}")
    return layers


def build_pipeline_model_from_cfg(
    config: Mapping[str, object],
    num_chunks: int = 1,
    partition_method: Literal["parameter", "uniform"] = "parameter",
    verbose: bool = False,
) -> nn.Module:
    """Build only this stage's layers from a model config.

    Every layer is first built without memory (lazily) to count its parameters; only this
    stage's layers are then materialized.

    Args:
        config: ``dict(layers=[dict(type=..., ...), ...])``, or ``dict(type=Model, ...)`` of
            a registered model whose instances list their layers in ``layers_cfg``.
        num_chunks: Model chunks per stage.
        partition_method: ``'parameter'`` balances parameter counts, ``'uniform'`` layer
            counts.
        verbose: Log each rank's slice.

    Raises:
        ValueError: An unknown partition method or layer type.
    """
    if partition_method not in ("parameter", "uniform"):
        raise ValueError(f"partition_method={partition_method!r} is not 'parameter' or 'uniform'")
    configs = _layer_configs(config)
    with LazyInitContext():
        lazy = [build_layer(c) for c in configs]
    stage, stages = stage_rank()
    parts: Parts
    if partition_method == "uniform":
        parts = partition_uniform(len(lazy), stages, num_chunks)
    else:
        counts = [float(sum(p.numel() for p in layer.parameters())) for layer in lazy]
        parts = partition_balanced(counts, stages, num_chunks)
    mine = parts[stage]
    if verbose:
        logger.info("pipeline stage %d/%d builds layers %s of %d", stage, stages, mine, len(lazy))
    whole = nn.Sequential(*lazy)
    model = _slices(whole, mine)
    LazyInitContext.materialize(model)
    return model
