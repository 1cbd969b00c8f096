"""GPT-2 tensor-parallel policy (transformers 5.x module tree).

Per block: ``attn.c_attn`` (a fused q/k/v ``Conv1D``) is column-parallel in three blocks,
``attn.c_proj`` row-parallel; ``mlp.c_fc`` column-, ``mlp.c_proj`` row-parallel. The attention
forward reads ``split_size`` (to split the fused output) and ``num_heads``; both are divided by
the tensor-parallel size (``head_dim`` is unchanged). ``wte`` is vocab-parallel and the LM head,
tied to it, a vocab-parallel LM head; classification heads stay replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colossal.shardformer.pipeline.plan import StagePlan
from colossal.shardformer.policies._common import TPPolicy, dropout_descriptions
from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    PolicyMap,
    SubModuleReplacementDescription,
)

if TYPE_CHECKING:
    from colossal.shardformer.grid import GridPlan

__all__ = ["POLICIES", "GPT2LMHeadModelPolicy", "GPT2Policy"]


class GPT2Policy(TPPolicy):
    """GPT-2 base model and replicated heads (sequence/token classification, QA)."""

    def config_sanity_check(self) -> None:
        """Heads must divide; cross-attention (``add_cross_attention``) is not sharded."""
        assert self.model is not None
        config = self.model.config
        if getattr(config, "add_cross_attention", False):
            raise ValueError(
                f"{type(self.model).__name__}: tensor parallelism of GPT-2 cross-attention "
                "(config.add_cross_attention=True) is not supported; pass a custom policy"
            )
        self.divide(config.n_head, "num_attention_heads")

    def embedding_suffix(self) -> str | None:
        """The word embedding."""
        return "wte"

    def stage_plan(self) -> StagePlan:
        """``wte``/``wpe``/``drop`` on the first stage, ``h`` split, ``ln_f`` on the last."""
        return StagePlan(
            layers="h",
            first={"wte": "input", "wpe": "zero", "drop": "identity"},
            last={"ln_f": "identity"},
        )

    def layer_policy(self) -> PolicyMap:
        """Attention and MLP of every block, plus the embedding dropout."""
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Model

        from colossal.shardformer.layer import (
            GPT2FusedLinearConv1D_Col,
            GPT2FusedLinearConv1D_Row,
        )

        assert self.model is not None
        config = self.model.config
        policy: PolicyMap = {
            GPT2Attention: ModulePolicyDescription(
                attribute_replacement={
                    "num_heads": self.divide(config.n_head, "num_attention_heads"),
                    "split_size": self.divide(config.hidden_size, "hidden_size"),
                },
                sub_module_replacement=[
                    SubModuleReplacementDescription(
                        suffix="c_attn",
                        target_module=GPT2FusedLinearConv1D_Col,
                        kwargs={"n_fused": 3},
                    ),
                    SubModuleReplacementDescription(
                        suffix="c_proj", target_module=GPT2FusedLinearConv1D_Row
                    ),
                    *dropout_descriptions(["resid_dropout"]),
                    # eager attention applies module.attn_dropout to this rank's heads
                    *dropout_descriptions(["attn_dropout"], parallel=True),
                ],
                tp_region_inputs=[""],
            ),
            GPT2MLP: ModulePolicyDescription(
                sub_module_replacement=[
                    SubModuleReplacementDescription(
                        suffix="c_fc", target_module=GPT2FusedLinearConv1D_Col
                    ),
                    SubModuleReplacementDescription(
                        suffix="c_proj", target_module=GPT2FusedLinearConv1D_Row
                    ),
                    *dropout_descriptions(["dropout"]),
                ],
            ),
            GPT2Model: ModulePolicyDescription(
                sub_module_replacement=dropout_descriptions(["drop"])
            ),
        }
        return policy


    def grid_plan(self) -> GridPlan:
        """The 2D / 2.5D / 3D plan of the ``h`` blocks.

        ``c_attn`` (q, k, v fused) and ``mlp.c_fc`` read the hidden state, the two ``c_proj``
        write back; ``ln_1``/``ln_2`` are grid norms; the attention's ``num_heads`` and
        ``split_size`` are divided by ``q``.
        """
        from colossal.shardformer.grid import GridPlan

        assert self.model is not None
        config = self.model.config
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        return GridPlan(
            layers=f"{self.base_prefix}h",
            linears={"attn.c_attn": "in", "attn.c_proj": "out", "mlp.c_fc": "in",
                     "mlp.c_proj": "out"},
            fused={"attn.c_attn": 3},
            norms=("ln_1", "ln_2"),
            heads={"attn.num_heads": config.n_head, "attn.split_size": config.hidden_size},
            widths={"hidden_size": config.hidden_size, "n_inner": inner},
            head_counts={"num_attention_heads": config.n_head},
        )  # fmt: skip


class GPT2LMHeadModelPolicy(GPT2Policy):
    """``GPT2LMHeadModel``: vocab-parallel tied LM head and the vocab-parallel causal loss."""

    lm_head = "lm_head"
    loss = "causal"


POLICIES: dict[str, type[TPPolicy]] = {
    "GPT2Model": GPT2Policy,
    "GPT2LMHeadModel": GPT2LMHeadModelPolicy,
    "GPT2ForSequenceClassification": GPT2Policy,
    "GPT2ForTokenClassification": GPT2Policy,
    "GPT2ForQuestionAnswering": GPT2Policy,
}
