"""ViT tensor-parallel policy (transformers 5.x module tree).

transformers 5.x renamed ViT's modules: ``ViTModel.layers[i]`` holds ``attention`` (a
``ViTAttention`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj``) and ``mlp`` (``ViTMLP``
with ``fc1``/``fc2``). q/k/v are column-parallel (the attention's input enters the
tensor-parallel region once), ``o_proj`` row-parallel, ``fc1`` column-, ``fc2``
row-parallel. The attention forward reshapes with ``head_dim`` (unchanged) and ``-1`` heads;
``num_attention_heads`` is divided so the module describes what it holds. Patch embedding,
pooler and the image-classification head stay replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colossal.shardformer.pipeline.plan import StagePlan
from colossal.shardformer.policies._common import TPPolicy, col, dropout_descriptions, row
from colossal.shardformer.policies.base_policy import ModulePolicyDescription, PolicyMap

if TYPE_CHECKING:
    from colossal.shardformer.grid import GridPlan

__all__ = ["POLICIES", "ViTPolicy"]


class ViTPolicy(TPPolicy):
    """ViT base model and the image-classification head."""

    def config_sanity_check(self) -> None:
        """The head count must divide by the tensor-parallel size."""
        assert self.model is not None
        self.divide(self.model.config.num_attention_heads, "num_attention_heads")

    def stage_plan(self) -> StagePlan:
        """``embeddings`` first, ``layers`` split, ``layernorm``/``pooler`` last.

        Later stages receive the hidden state as ``pixel_values`` (the forward requires it
        and reads the patch projection's dtype, which a zero-size probe provides).
        """
        return StagePlan(
            layers="layers",
            first={"embeddings": "input"},
            last={"layernorm": "identity", "pooler": "identity"},
            feed="pixel_values",
            dtype_probes={"embeddings": "patch_embeddings.projection.weight"},
        )

    def grid_plan(self) -> GridPlan:
        """The 2D / 2.5D / 3D plan of the ``layers`` blocks.

        q/k/v and ``mlp.fc1`` read the hidden state, ``o_proj`` and ``mlp.fc2`` write back;
        ``layernorm_before``/``layernorm_after`` are grid norms; the attention's head count is
        divided by ``q``. Patch embedding, final norm, pooler and classifier stay whole.
        """
        from colossal.shardformer.grid import GridPlan

        assert self.model is not None
        config = self.model.config
        return GridPlan(
            layers=f"{self.base_prefix}layers",
            linears={
                "attention.q_proj": "in",
                "attention.k_proj": "in",
                "attention.v_proj": "in",
                "attention.o_proj": "out",
                "mlp.fc1": "in",
                "mlp.fc2": "out",
            },
            norms=("layernorm_before", "layernorm_after"),
            heads={"attention.num_attention_heads": config.num_attention_heads},
            widths={
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
            },
            head_counts={"num_attention_heads": config.num_attention_heads},
        )

    def layer_policy(self) -> PolicyMap:
        """Attention and MLP of every layer, plus the replicated dropouts."""
        from transformers.models.vit.modeling_vit import (
            ViTAttention,
            ViTEmbeddings,
            ViTLayer,
            ViTMLP,
        )

        assert self.model is not None
        config = self.model.config
        return {
            ViTAttention: ModulePolicyDescription(
                attribute_replacement={
                    "num_attention_heads": self.divide(
                        config.num_attention_heads, "num_attention_heads"
                    )
                },
                sub_module_replacement=[
                    col("q_proj"),
                    col("k_proj"),
                    col("v_proj"),
                    row("o_proj"),
                ],
                tp_region_inputs=[""],
            ),
            ViTMLP: ModulePolicyDescription(sub_module_replacement=[col("fc1"), row("fc2")]),
            ViTLayer: ModulePolicyDescription(
                sub_module_replacement=dropout_descriptions(["dropout"])
            ),
            ViTEmbeddings: ModulePolicyDescription(
                sub_module_replacement=dropout_descriptions(["dropout"])
            ),
        }


POLICIES: dict[str, type[TPPolicy]] = {
    "ViTModel": ViTPolicy,
    "ViTForImageClassification": ViTPolicy,
}
