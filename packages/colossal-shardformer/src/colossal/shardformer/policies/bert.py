"""BERT tensor-parallel policy (transformers 5.x module tree).

Per layer: ``attention.self.{query,key,value}`` column-parallel (the self-attention's input
enters the tensor-parallel region once, so q, k and v share one backward all-reduce),
``attention.output.dense`` row-parallel, ``intermediate.dense`` column-, ``output.dense``
row-parallel. The attention forward reshapes with ``attention_head_size`` (unchanged) and
``-1`` heads; ``num_attention_heads`` and ``all_head_size`` are divided so the module
describes what it holds. ``word_embeddings`` is vocab-parallel and the MLM decoder (tied to
it) a vocab-parallel LM head; pooler and classification heads stay replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from colossal.shardformer.pipeline.plan import StagePlan
from colossal.shardformer.policies._common import TPPolicy, col, dropout_descriptions, row
from colossal.shardformer.policies.base_policy import ModulePolicyDescription, PolicyMap

if TYPE_CHECKING:
    from colossal.shardformer.grid import GridPlan

__all__ = [
    "POLICIES",
    "BertForMaskedLMPolicy",
    "BertForPreTrainingPolicy",
    "BertLMHeadModelPolicy",
    "BertPolicy",
]


class BertPolicy(TPPolicy):
    """BERT base model and replicated heads (sequence/token classification, QA, ...)."""

    def config_sanity_check(self) -> None:
        """The head count must divide by the tensor-parallel size."""
        assert self.model is not None
        self.divide(self.model.config.num_attention_heads, "num_attention_heads")

    def embedding_suffix(self) -> str | None:
        """The word embedding."""
        return "embeddings.word_embeddings"

    def stage_plan(self) -> StagePlan:
        """``embeddings`` on the first stage, ``encoder.layer`` split, ``pooler`` on the last."""
        return StagePlan(
            layers="encoder.layer", first={"embeddings": "input"}, last={"pooler": "identity"}
        )

    def layer_policy(self) -> PolicyMap:
        """Self/cross attention, attention output, intermediate and output of every layer."""
        from transformers.models.bert.modeling_bert import (
            BertCrossAttention,
            BertEmbeddings,
            BertIntermediate,
            BertOutput,
            BertSelfAttention,
            BertSelfOutput,
        )

        assert self.model is not None
        config = self.model.config
        heads = self.divide(config.num_attention_heads, "num_attention_heads")
        head_size = config.hidden_size // config.num_attention_heads
        attrs = {"num_attention_heads": heads, "all_head_size": heads * head_size}
        qkv = [col("query"), col("key"), col("value")]
        return {
            BertSelfAttention: ModulePolicyDescription(
                attribute_replacement=dict(attrs),
                sub_module_replacement=list(qkv),
                tp_region_inputs=[""],
            ),
            # Cross-attention reads two inputs (q from the decoder, k/v from the encoder):
            # each column-parallel projection all-reduces its own input gradient.
            BertCrossAttention: ModulePolicyDescription(
                attribute_replacement=dict(attrs), sub_module_replacement=list(qkv)
            ),
            BertSelfOutput: ModulePolicyDescription(
                sub_module_replacement=[row("dense"), *dropout_descriptions(["dropout"])]
            ),
            BertIntermediate: ModulePolicyDescription(sub_module_replacement=[col("dense")]),
            BertOutput: ModulePolicyDescription(
                sub_module_replacement=[row("dense"), *dropout_descriptions(["dropout"])]
            ),
            BertEmbeddings: ModulePolicyDescription(
                sub_module_replacement=dropout_descriptions(["dropout"])
            ),
        }

    def grid_plan(self) -> GridPlan:
        """The 2D / 2.5D / 3D plan of the ``encoder.layer`` blocks.

        q/k/v and ``intermediate.dense`` read the hidden state, the two output ``dense``
        layers write back; both ``LayerNorm`` are grid norms; the self-attention's head count
        and ``all_head_size`` are divided by ``q``. Embeddings, pooler and heads stay whole.

        Raises:
            NotImplementedError: Cross-attention (``add_cross_attention``).
        """
        from colossal.shardformer.grid import GridPlan

        assert self.model is not None
        config = self.model.config
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                f"{type(self.model).__name__}: the grid tensor-parallel modes do not shard BERT "
                "cross-attention (config.add_cross_attention=True); use tensor_parallel_mode='1d'"
            )
        return GridPlan(
            layers=f"{self.base_prefix}encoder.layer",
            linears={
                "attention.self.query": "in",
                "attention.self.key": "in",
                "attention.self.value": "in",
                "attention.output.dense": "out",
                "intermediate.dense": "in",
                "output.dense": "out",
            },
            norms=("attention.output.LayerNorm", "output.LayerNorm"),
            heads={
                "attention.self.num_attention_heads": config.num_attention_heads,
                "attention.self.all_head_size": config.hidden_size,
            },
            widths={
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
            },
            head_counts={"num_attention_heads": config.num_attention_heads},
        )

    def after_lm_head(self, native: nn.Module, head: nn.Module) -> None:
        """Keep ``cls.predictions.bias`` the decoder's bias (HF ties them) once it is sharded."""
        assert self.model is not None
        predictions = self.model.get_submodule("cls.predictions")
        old = getattr(native, "bias", None)
        if old is not None and getattr(predictions, "bias", None) is old:
            predictions.bias = head.bias


class BertForMaskedLMPolicy(BertPolicy):
    """``BertForMaskedLM``: vocab-parallel tied decoder and vocab-parallel (unshifted) CE."""

    lm_head = "cls.predictions.decoder"
    loss = "masked"


class BertLMHeadModelPolicy(BertPolicy):
    """``BertLMHeadModel`` (decoder): vocab-parallel tied decoder and the causal loss."""

    lm_head = "cls.predictions.decoder"
    loss = "causal"


class BertForPreTrainingPolicy(BertPolicy):
    """``BertForPreTraining``: vocab-parallel decoder whose logits are always gathered.

    Its forward adds the masked-LM and next-sentence losses inline on full-vocabulary
    logits, so the decoder gathers them (``parallel_output`` is ignored for this head).
    """

    lm_head = "cls.predictions.decoder"
    loss = None

    def gather_logits(self) -> bool:
        """Always gather: the model's own loss needs the whole vocabulary."""
        return True


POLICIES: dict[str, type[TPPolicy]] = {
    "BertModel": BertPolicy,
    "BertForMaskedLM": BertForMaskedLMPolicy,
    "BertLMHeadModel": BertLMHeadModelPolicy,
    "BertForPreTraining": BertForPreTrainingPolicy,
    "BertForSequenceClassification": BertPolicy,
    "BertForTokenClassification": BertPolicy,
    "BertForMultipleChoice": BertPolicy,
    "BertForQuestionAnswering": BertPolicy,
    "BertForNextSentencePrediction": BertPolicy,
}
