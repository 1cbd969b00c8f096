"""Held-out accuracy and loss of a boosted ViT, under any plugin (pipelines included).

Every data-parallel replica evaluates the whole held-out set (360 images: one forward is
cheap), because Gemini and tensor parallelism run collectives inside the forward, so every
rank has to take part in every batch. One rank counts: the first replica's tensor-parallel
rank 0, on the last pipeline stage when there is a pipeline. Its sums reach every rank in
one all-reduce.

Under pipeline parallelism evaluation runs a forward pipeline of its own under
``torch.no_grad()`` (the schedule's forward-only mode, ``booster.execute_pipeline`` under
``no_grad``, would split every batch into its microbatches, which 360 images need not
divide): the first stage calls its part of the model on the images and sends
the hidden states (a dict) to the next stage with a :class:`colossal.pipeline.PipelineP2P` of
its own, on a tag the schedule does not use; the last stage computes the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from data import DigitsDataset
from torch import nn
from torch.nn import functional as F  # noqa: N812

__all__ = ["EVAL_TAG", "evaluate", "is_reporter"]

EVAL_TAG = 4096
"""Point-to-point tag of the evaluation pipeline (apart from the training schedule's)."""


def _coordinate(plugin: Any, axis: str) -> int:
    dims = getattr(plugin, "parallel_dims", None)
    return dims.coordinate(axis) if dims is not None else dist.get_rank()


def is_reporter(plugin: Any) -> bool:
    """Whether this rank holds the logits and losses that count (one rank per dp replica).

    That is tensor-parallel rank 0 on the last pipeline stage (or anywhere without a
    pipeline); every data-parallel rank is one, each with its own batches.
    """
    stage_manager = getattr(plugin, "stage_manager", None)
    if stage_manager is not None and not stage_manager.is_last_stage():
        return False
    return _coordinate(plugin, "tp") == 0


def _logits(output: Any) -> torch.Tensor:
    return (output.logits if hasattr(output, "logits") else output[0]).float()


def _pipeline_logits(plugin: Any, stage: nn.Module, images: torch.Tensor, p2p: Any) -> Any:
    """This stage's forward of one batch; the logits on the last stage, else None."""
    sm = plugin.stage_manager
    if sm.is_first_stage():
        output = stage(pixel_values=images.to(plugin.precision_dtype))
    else:
        output = stage(**p2p.recv(sm.prev_rank, tag=EVAL_TAG))
    if sm.is_last_stage():
        return _logits(output)
    p2p.send(output, sm.next_rank, tag=EVAL_TAG)
    return None


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: DigitsDataset, plugin: Any, batch_size: int = 180
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy on ``dataset``, the same values on every rank.

    Args:
        model: The boosted model (a pipeline stage under ``pp_size > 1``).
        dataset: The held-out images.
        plugin: The booster's plugin (its layout says who counts).
        batch_size: Images per forward.

    Returns:
        ``(accuracy, loss)``.
    """
    stage_manager = getattr(plugin, "stage_manager", None)
    p2p = None
    if stage_manager is not None:
        from colossal.pipeline import PipelineP2P

        if stage_manager.num_model_chunks != 1:
            raise ValueError("evaluation runs one model chunk per stage (pp_style='1f1b')")
        p2p = PipelineP2P(stage_manager.pp_group)
    counts = is_reporter(plugin) and _coordinate(plugin, "dp") == 0
    sums = torch.zeros(3, dtype=torch.float64)  # correct, summed loss, images
    was_training = model.training
    model.eval()
    for start in range(0, len(dataset), batch_size):
        images = dataset.images[start : start + batch_size]
        labels = dataset.labels[start : start + batch_size]
        if p2p is None:
            logits = _logits(model(pixel_values=images))
        else:
            logits = _pipeline_logits(plugin, model.unwrap(), images, p2p)
        if counts and logits is not None:
            sums[0] += (logits.argmax(-1) == labels).sum().item()
            sums[1] += F.cross_entropy(logits, labels, reduction="sum").item()
            sums[2] += labels.numel()
    if p2p is not None:
        p2p.wait_all()
    model.train(was_training)
    dist.all_reduce(sums)
    if sums[2].item() == 0:
        raise RuntimeError("no rank counted the held-out set (no reporting rank)")
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
