"""colossal-shardformer: tensor parallelism for Hugging Face transformers 5.x models.

``ShardFormer(ShardConfig(tensor_parallel_process_group=group)).optimize(model)`` shards a
model in place and returns it with its shared parameters. Policies are data (which submodule
becomes which parallel layer, which attribute is divided, where the tensor-parallel region
starts); attention runs through transformers' ``AttentionInterface``; no model ``forward`` is
rewritten. Hand-written policies cover GPT-2, BERT, ViT, OPT and Bloom; any model whose config
has a ``base_model_tp_plan`` (Llama, Mistral, Qwen2 and many more) gets a derived policy.
"""

from colossal.shardformer import d_tensor
from colossal.shardformer.__about__ import __version__
from colossal.shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    cross_entropy_1d,
)
from colossal.shardformer.pipeline import StagePlan, split_into_stages
from colossal.shardformer.policies import (
    ModulePolicyDescription,
    Policy,
    SubModuleReplacementDescription,
    TPPlanPolicy,
    get_autopolicy,
)
from colossal.shardformer.sequence import SequenceParallelGradSync
from colossal.shardformer.shard import ShardConfig, ShardFormer
from colossal.shardformer.shard.grad_ckpt import PipelineGradientCheckpointConfig

__all__ = [
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "ModulePolicyDescription",
    "PipelineGradientCheckpointConfig",
    "Policy",
    "SequenceParallelGradSync",
    "ShardConfig",
    "ShardFormer",
    "StagePlan",
    "SubModuleReplacementDescription",
    "TPPlanPolicy",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "__version__",
    "cross_entropy_1d",
    "d_tensor",
    "get_autopolicy",
    "split_into_stages",
]
