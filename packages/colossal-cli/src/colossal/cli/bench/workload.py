"""What one benchmark step trains: the model of a configuration, its data and its step.

The ``"gpt"`` workload is :class:`colossal.cli.bench.gpt.GPT`, called as ``model(idx,
targets) -> loss``. The ``"hf-gpt2"`` workload is the same shape as a transformers
``GPT2LMHeadModel`` (untied head, GELU, no dropout: the same parameter count), for plugins
that shard Hugging Face models; it is called with ``input_ids``, ``labels`` and
``shift_labels`` (the targets are already shifted) and returns ``.loss`` (vocab-parallel
under tensor parallelism). Under a pipeline a step is ``booster.execute_pipeline`` and the
loss lives on the last stage only (``None`` elsewhere).

Every configuration trains the same global batch, ``batch_size x world`` samples: each
data-parallel replica draws ``batch_size x world / dp`` of them, the same on every rank of
the replica (the ranks of a tensor-parallel group or a pipeline must see the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.cli.bench.configs import BenchConfig
from colossal.cli.bench.gpt import GPT, GPTConfig

if TYPE_CHECKING:  # the meta-package is optional for the CLI: never imported at run time here
    from colossal.booster import Booster
    from colossal.core import OptimizerWrapper

__all__ = ["StepFn", "build_model", "data_replica", "hf_gpt2", "make_step", "mean_over_holders"]

StepFn = Callable[[torch.Tensor], "torch.Tensor | None"]
"""One training step (forward and backward, no optimizer step) on ``[batch, seq + 1]`` tokens."""

NEEDS_TRANSFORMERS = (
    "the 'hf-gpt2' workload needs transformers, which the colossal meta-package installs "
    "(with colossal-shardformer): pip install colossal"
)


def hf_gpt2(cfg: GPTConfig) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` of ``cfg``'s shape (``cfg.num_params()`` parameters).

    Raises:
        ModuleNotFoundError: transformers is not installed (the message says how to get it).
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(NEEDS_TRANSFORMERS, name=exc.name) from exc
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def build_model(cfg: BenchConfig, model_cfg: GPTConfig) -> nn.Module:
    """The model ``cfg``'s workload trains, on the CPU (the caller moves it)."""
    return hf_gpt2(model_cfg) if cfg.workload == "hf-gpt2" else GPT(model_cfg)


def data_replica(plugin: object) -> tuple[int, int]:
    """``(index, count)`` of this rank's data-parallel replica.

    Every rank is a replica of its own (``(rank, world)``) unless the plugin has a
    data-parallel axis smaller than the world (hybrid parallelism).
    """
    dims = getattr(plugin, "parallel_dims", None)
    dp = getattr(plugin, "dp_size", None)
    if dims is not None and isinstance(dp, int) and dp != dist.get_world_size():
        return int(dims.coordinate("dp")), dp
    return dist.get_rank(), dist.get_world_size()


def _hf_batch(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    targets = tokens[:, 1:]
    return {"input_ids": tokens[:, :-1], "labels": targets, "shift_labels": targets}


def _hf_loss(outputs: Any, microbatch: Any) -> torch.Tensor:
    return outputs.loss


def make_step(
    cfg: BenchConfig, booster: Booster, model: nn.Module, optimizer: OptimizerWrapper
) -> StepFn:
    """The forward and backward of one step of ``cfg``.

    The returned function gives the loss, or None on a pipeline stage before the last.
    """
    plugin = booster.plugin
    if cfg.workload == "hf-gpt2" and plugin is not None and plugin.support_pipeline():

        def pipeline_step(tokens: torch.Tensor) -> torch.Tensor | None:
            out = booster.execute_pipeline(
                iter([_hf_batch(tokens)]), model, _hf_loss, optimizer, return_loss=True
            )
            return out["loss"]

        return pipeline_step

    def step(tokens: torch.Tensor) -> torch.Tensor:
        if cfg.workload == "hf-gpt2":
            loss = model(**_hf_batch(tokens)).loss
        else:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        booster.backward(loss, optimizer)
        return loss

    return step


def mean_over_holders(value: float | None, device: torch.device) -> float:
    """``value`` averaged over the ranks that hold one (None elsewhere); NaN if none does."""
    t = torch.zeros(2, dtype=torch.float64, device=device)
    if value is not None:
        t[0], t[1] = value, 1.0
    dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else float("nan")
