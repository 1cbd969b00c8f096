"""Pipeline stages for transformers models: stages as data, one stage forward for all.

``split_into_stages(model, policy, config)`` (called by ``ShardFormer.optimize`` when the
shard config has a ``pipeline_stage_manager``) returns this rank's model chunks and the
parameters tied across stages. The policy's :meth:`~colossal.shardformer.Policy.stage_plan`
says which modules the first and the last stage own (:class:`StagePlan`); GPT-2, BERT, ViT,
OPT and Bloom have written plans, other families derive theirs from
``config.base_model_pp_plan``. colossal-pipeline is never imported: the stage manager is
duck-typed.
"""

from colossal.shardformer.pipeline.held_layers import HeldLayers
from colossal.shardformer.pipeline.manager import StageLayoutLike, StageManagerLike
from colossal.shardformer.pipeline.placeholders import (
    PLACEHOLDER_KINDS,
    StagePlaceholder,
    is_placeholder,
    skip_placeholders,
)
from colossal.shardformer.pipeline.plan import StagePlan, derive_stage_plan
from colossal.shardformer.pipeline.split import (
    SharedParameter,
    split_into_stages,
    stage_layer_ranges,
)
from colossal.shardformer.pipeline.stage import HIDDEN_KEY, StageForward

__all__ = [
    "HIDDEN_KEY",
    "PLACEHOLDER_KINDS",
    "HeldLayers",
    "SharedParameter",
    "StageForward",
    "StageLayoutLike",
    "StageManagerLike",
    "StagePlaceholder",
    "StagePlan",
    "derive_stage_plan",
    "is_placeholder",
    "skip_placeholders",
    "split_into_stages",
    "stage_layer_ranges",
]
