"""What the trainer integrations need to know about a Colossal plugin (shared checks)."""

from __future__ import annotations

import torch.distributed as dist

from colossal.booster.plugin import DPPluginBase, Plugin
from colossal.core import parse_precision

__all__ = ["check_plugin", "data_parallel_layout", "plugin_precision"]


def check_plugin(plugin: object, owner: str) -> Plugin:
    """Return ``plugin`` if ``owner`` can train with it; refuse pipeline parallelism.

    The trainers' loops call the model once per micro-batch and back-propagate the loss
    themselves; a pipeline schedule (``Booster.execute_pipeline``) owns both, so it cannot
    run inside them.

    Raises:
        TypeError: ``plugin`` is not a Colossal plugin.
        ValueError: The plugin runs pipeline stages (``pp_size > 1``).
    """
    if not isinstance(plugin, Plugin):
        raise TypeError(
            f"{owner} needs plugin= a colossal.booster.plugin.Plugin (e.g. "
            f"LowLevelZeroPlugin(), GeminiPlugin(), HybridParallelPlugin(tp_size=2)), got "
            f"{type(plugin).__name__}"
        )
    pp_size = int(getattr(plugin, "pp_size", 1) or 1)
    if pp_size > 1:
        raise ValueError(
            f"{owner} cannot run {type(plugin).__name__}(pp_size={pp_size}): its loop calls the "
            "model per micro-batch and runs backward itself, while pipeline stages need "
            "booster.execute_pipeline to schedule both; use pp_size=1 (tensor, sequence and "
            "data parallelism work) or a plain Booster loop for pipelines"
        )
    return plugin


def data_parallel_layout(plugin: Plugin) -> tuple[int, int]:
    """``(dp_size, dp_rank)``: how many different batches a step sees and which one is ours.

    Ranks of one tensor/sequence-parallel group share a batch, so the dataloader must be
    split over the data-parallel ranks only.
    """
    if isinstance(plugin, DPPluginBase):
        return int(plugin.world_size), int(plugin.rank)
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def plugin_precision(plugin: Plugin) -> str:
    """The precision the plugin trains in (``"fp32"``, ``"fp16"``, ``"bf16"``)."""
    config = getattr(plugin, "config", None)
    value = getattr(config, "precision", None)
    if value is None:
        return "fp32"
    return str(parse_precision(value).value)
