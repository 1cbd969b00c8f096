"""OPT tensor-parallel policy (transformers 5.x module tree).

Per decoder layer: ``self_attn.{q,k,v}_proj`` column-parallel (the attention's input enters
the tensor-parallel region once), ``self_attn.out_proj`` row-parallel, ``fc1`` column-,
``fc2`` row-parallel. The attention forward reshapes with ``num_heads`` and ``head_dim``;
``num_heads`` is divided. ``decoder.embed_tokens`` is vocab-parallel and the LM head (tied to
it) a vocab-parallel LM head; ``project_in``/``project_out`` and the sequence-classification
head stay replicated.
"""

from __future__ import annotations

from colossal.shardformer.pipeline.plan import StagePlan
from colossal.shardformer.policies._common import TPPolicy, col, row
from colossal.shardformer.policies.base_policy import ModulePolicyDescription, PolicyMap

__all__ = ["POLICIES", "OPTForCausalLMPolicy", "OPTPolicy"]


class OPTPolicy(TPPolicy):
    """OPT base model and replicated heads (sequence classification, QA)."""

    def config_sanity_check(self) -> None:
        """The head count must divide by the tensor-parallel size."""
        assert self.model is not None
        self.divide(self.model.config.num_attention_heads, "num_attention_heads")

    def embedding_suffix(self) -> str | None:
        """The word embedding."""
        return "decoder.embed_tokens"

    def stage_plan(self) -> StagePlan:
        """Embeddings and ``project_in`` first, ``decoder.layers`` split, norm/out last."""
        return StagePlan(
            layers="decoder.layers",
            first={
                "decoder.embed_tokens": "input",
                "decoder.embed_positions": "zero",
                "decoder.project_in": "identity",
            },
            last={"decoder.final_layer_norm": "identity", "decoder.project_out": "identity"},
        )

    def layer_policy(self) -> PolicyMap:
        """Attention and MLP of every decoder layer."""
        from transformers.models.opt.modeling_opt import OPTAttention, OPTDecoderLayer

        assert self.model is not None
        config = self.model.config
        return {
            OPTAttention: ModulePolicyDescription(
                attribute_replacement={
                    "num_heads": self.divide(config.num_attention_heads, "num_attention_heads")
                },
                sub_module_replacement=[
                    col("q_proj"),
                    col("k_proj"),
                    col("v_proj"),
                    row("out_proj"),
                ],
                tp_region_inputs=[""],
            ),
            OPTDecoderLayer: ModulePolicyDescription(
                sub_module_replacement=[col("fc1"), row("fc2")]
            ),
        }


class OPTForCausalLMPolicy(OPTPolicy):
    """``OPTForCausalLM``: vocab-parallel tied LM head and the vocab-parallel causal loss."""

    lm_head = "lm_head"
    loss = "causal"


POLICIES: dict[str, type[TPPolicy]] = {
    "OPTModel": OPTPolicy,
    "OPTForCausalLM": OPTForCausalLMPolicy,
    "OPTForSequenceClassification": OPTPolicy,
    "OPTForQuestionAnswering": OPTPolicy,
}
