"""Bloom tensor-parallel policy (transformers 5.x module tree).

Per block: ``self_attention.query_key_value`` is column-parallel. Bloom lays the fused
projection out per head (``[head][q|k|v][head_dim]``), so an even split of its output hands
each rank whole heads with their q, k and v: a plain column split, no fused blocks. The
attention's input enters the tensor-parallel region once; ``self_attention.dense`` is
row-parallel, ``mlp.dense_h_to_4h`` column-, ``mlp.dense_4h_to_h`` row-parallel. The attention
forward reshapes with ``num_heads`` (divided) and ``head_dim`` (unchanged).

ALiBi: ``BloomModel`` builds the bias for all ``n_head`` heads (its ``num_heads`` is left
whole); a forward pre-hook on each sharded ``BloomAttention`` hands it the rows of ITS heads
(``alibi`` is ``(batch * n_head, 1, kv)``, batch-major). No forward is replaced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.shardformer.pipeline.plan import StagePlan
from colossal.shardformer.policies._common import TPPolicy, col, dropout_descriptions, row
from colossal.shardformer.policies.base_policy import ModulePolicyDescription, PolicyMap

__all__ = ["POLICIES", "BloomForCausalLMPolicy", "BloomPolicy", "slice_alibi"]


def slice_alibi(alibi: torch.Tensor, num_heads: int, rank: int, tp_size: int) -> torch.Tensor:
    """The rows of ``alibi`` (``(batch * num_heads, 1, kv)``) for ``rank``'s heads.

    Args:
        alibi: The bias for all heads, batch-major.
        num_heads: The whole model's head count.
        rank: This rank's index in the tensor-parallel group.
        tp_size: The tensor-parallel size.

    Returns:
        ``(batch * num_heads // tp_size, 1, kv)``: heads ``rank * h`` to ``(rank + 1) * h``.
    """
    if alibi.shape[0] % num_heads != 0:
        raise ValueError(
            f"alibi has {alibi.shape[0]} rows, not a multiple of num_heads={num_heads}"
        )
    local = num_heads // tp_size
    batch = alibi.shape[0] // num_heads
    per_head = alibi.reshape(batch, num_heads, *alibi.shape[1:])
    mine = per_head[:, rank * local : (rank + 1) * local]
    return mine.reshape(batch * local, *alibi.shape[1:])


class _AlibiSlicer:
    """Forward pre-hook giving a sharded ``BloomAttention`` the ALiBi rows of its heads."""

    def __init__(self, num_heads: int, rank: int, tp_size: int) -> None:
        self.num_heads, self.rank, self.tp_size = num_heads, rank, tp_size

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "alibi" in kwargs:
            kwargs["alibi"] = slice_alibi(kwargs["alibi"], self.num_heads, self.rank, self.tp_size)
        elif len(args) > 2:  # forward(hidden_states, residual, alibi, ...)
            sliced = slice_alibi(args[2], self.num_heads, self.rank, self.tp_size)
            args = (*args[:2], sliced, *args[3:])
        return args, kwargs


class BloomPolicy(TPPolicy):
    """Bloom base model and replicated heads (sequence/token classification, QA)."""

    def config_sanity_check(self) -> None:
        """Heads must divide; the ``slow_but_exact`` emulation of pretraining TP is refused."""
        assert self.model is not None
        config = self.model.config
        self.divide(config.n_head, "n_head")
        if config.pretraining_tp > 1 and config.slow_but_exact and self.tp_size > 1:
            raise ValueError(
                f"{type(self.model).__name__}: config.slow_but_exact=True with "
                f"pretraining_tp={config.pretraining_tp} slices the dense weights by the "
                "pretraining tensor-parallel layout and cannot be sharded; set "
                "config.slow_but_exact=False"
            )

    def embedding_suffix(self) -> str | None:
        """The word embedding."""
        return "word_embeddings"

    def stage_plan(self) -> StagePlan:
        """Embedding and its norm first, ``h`` split, ``ln_f`` last (ALiBi on every stage)."""
        return StagePlan(
            layers="h",
            first={"word_embeddings": "input", "word_embeddings_layernorm": "identity"},
            last={"ln_f": "identity"},
        )

    def layer_policy(self) -> PolicyMap:
        """Attention and MLP of every block."""
        from transformers.models.bloom.modeling_bloom import BloomAttention, BloomMLP

        assert self.model is not None
        config = self.model.config
        return {
            BloomAttention: ModulePolicyDescription(
                attribute_replacement={"num_heads": self.divide(config.n_head, "n_head")},
                sub_module_replacement=[
                    col("query_key_value"),
                    row("dense"),
                    *dropout_descriptions(["attention_dropout"], parallel=True),
                ],
                tp_region_inputs=[""],
            ),
            BloomMLP: ModulePolicyDescription(
                sub_module_replacement=[col("dense_h_to_4h"), row("dense_4h_to_h")]
            ),
        }

    def postprocess(self) -> nn.Module:
        """Hook every attention to its heads' ALiBi slopes, then the loss."""
        from transformers.models.bloom.modeling_bloom import BloomAttention

        assert self.model is not None and self.shard_config is not None
        tp = self.tp_size
        if self.shard_config.enable_tensor_parallelism and tp > 1:
            rank = dist.get_rank(self.process_group)
            for module in self.model.modules():
                if isinstance(module, BloomAttention) and not hasattr(module, "_colossal_alibi"):
                    slicer = _AlibiSlicer(self.model.config.n_head, rank, tp)
                    module._colossal_alibi = module.register_forward_pre_hook(  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module
                        slicer, with_kwargs=True
                    )
        return super().postprocess()


class BloomForCausalLMPolicy(BloomPolicy):
    """``BloomForCausalLM``: vocab-parallel tied LM head and the vocab-parallel causal loss."""

    lm_head = "lm_head"
    loss = "causal"


POLICIES: dict[str, type[TPPolicy]] = {
    "BloomModel": BloomPolicy,
    "BloomForCausalLM": BloomForCausalLMPolicy,
    "BloomForSequenceClassification": BloomPolicy,
    "BloomForTokenClassification": BloomPolicy,
    "BloomForQuestionAnswering": BloomPolicy,
}
