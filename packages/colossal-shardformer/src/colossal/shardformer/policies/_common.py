"""Shared pieces of the hand-written policies (GPT-2, BERT, ViT, OPT, Bloom).

Everything here is data or a hook: a base class with the tensor-parallel group and the
divisibility checks, a tie-aware vocab-parallel LM head factory, and the installers of the
vocab-parallel losses. No model ``forward`` is copied or replaced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    Policy,
    PolicyMap,
    SubModuleReplacementDescription,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = [
    "TPPolicy",
    "TiedVocabParallelLMHead",
    "install_masked_lm_loss",
]


class TPPolicy(Policy):
    """Base of the hand-written tensor-parallel policies.

    Subclasses set :attr:`lm_head` (the dotted name of a vocabulary projection, tied or not to
    the input embeddings) and :attr:`loss` (``"causal"``: the model calls
    ``self.loss_function``; ``"masked"``: the model computes an unshifted cross entropy inline;
    ``None``: no vocabulary loss), and implement :meth:`layer_policy` and
    :meth:`embedding_suffix`.
    """

    lm_head: str | None = None
    loss: str | None = None
    model: PreTrainedModel | None  # these policies shard Hugging Face models

    def __init__(self) -> None:
        super().__init__()
        self._native_embedding_weight: torch.Tensor | None = None

    # ----------------------------------------------------------------- group and sizes
    @property
    def process_group(self) -> Any:
        """The tensor-parallel process group (the world when the config gives none)."""
        assert self.shard_config is not None, "set_shard_config first"
        group = self.shard_config.tensor_parallel_process_group
        return dist.group.WORLD if group is None else group

    @property
    def base_prefix(self) -> str:
        """Dotted prefix (with a trailing dot) of the base model inside :attr:`model`."""
        assert self.model is not None
        prefix = getattr(self.model, "base_model_prefix", "")
        if prefix and hasattr(self.model, prefix):
            return f"{prefix}."
        return ""

    def divide(self, value: int, what: str) -> int:
        """``value // tp_size``, or a ValueError naming ``what`` when it does not divide."""
        tp = self.tp_size
        if value % tp != 0:
            raise ValueError(
                f"{type(self.model).__name__}: {what}={value} is not divisible by the "
                f"tensor-parallel size {tp}; choose a tensor-parallel size that divides {value}"
            )
        return value // tp

    # ----------------------------------------------------------------- the policy
    def preprocess(self) -> nn.Module:
        """Remember the input embedding weight (to keep an LM head tied to it)."""
        assert self.model is not None
        try:
            emb = self.model.get_input_embeddings()
        except AttributeError:  # a pipeline stage that does not hold the embedding
            emb = None
        self._native_embedding_weight = getattr(emb, "weight", None)
        return self.model

    def embedding_suffix(self) -> str | None:
        """Dotted name of the word embedding relative to the base model (None: no vocab)."""
        return None

    def layer_policy(self) -> PolicyMap:
        """Descriptions for the per-layer module classes (attention, MLP, ...)."""
        raise NotImplementedError

    def module_policy(self) -> PolicyMap:
        """Per-layer descriptions plus the embedding and LM head of the root model class."""
        assert self.model is not None and self.shard_config is not None
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        from colossal.shardformer.layer import VocabParallelEmbedding1D

        policy = self.layer_policy()
        # The embedding and the head are described on the ROOT class, in this order, so the
        # head can reuse the embedding's (already sharded) tied weight.
        root: list[SubModuleReplacementDescription] = []
        emb = self.embedding_suffix()
        multiple = self.shard_config.make_vocab_size_divisible_by
        if emb is not None:
            root.append(
                SubModuleReplacementDescription(
                    suffix=self.base_prefix + emb,
                    target_module=VocabParallelEmbedding1D,
                    kwargs={"make_vocab_size_divisible_by": multiple},
                )
            )
        if self.lm_head is not None:
            root.append(
                SubModuleReplacementDescription(
                    suffix=self.lm_head,
                    target_module=TiedVocabParallelLMHead(self),
                    kwargs={
                        "gather_output": self.gather_logits(),
                        "make_vocab_size_divisible_by": multiple,
                    },
                )
            )
        if root:
            policy.setdefault(type(self.model), ModulePolicyDescription())
            policy[type(self.model)].sub_module_replacement.extend(root)
        from colossal.shardformer.pipeline.placeholders import skip_placeholders

        return skip_placeholders(self.model, policy)  # a pipeline stage's stand-ins stay

    def after_lm_head(self, native: nn.Module, head: nn.Module) -> None:
        """Called once the LM head is built (re-tie other references to its parameters)."""

    def gather_logits(self) -> bool:
        """Whether the LM head gathers the logits (``not parallel_output``)."""
        assert self.shard_config is not None
        return not self.shard_config.parallel_output

    def postprocess(self) -> nn.Module:
        """Install the vocab-parallel loss when the logits stay sharded."""
        assert self.model is not None and self.shard_config is not None
        if not self.shard_config.enable_tensor_parallelism or self.lm_head is None:
            return self.model
        if self.gather_logits():
            return self.model  # full logits: the model's own loss is right
        from colossal.shardformer.pipeline.placeholders import is_placeholder, resolve_path

        if is_placeholder(resolve_path(self.model, self.lm_head)):
            return self.model  # a pipeline stage without the head computes no loss
        if self.loss == "causal":
            from colossal.shardformer.shard.model_hooks import install_vocab_parallel_loss

            install_vocab_parallel_loss(self.model, self.process_group)
        elif self.loss == "masked":
            install_masked_lm_loss(self.model, self.process_group, self.model.config.vocab_size)
        return self.model


class TiedVocabParallelLMHead:
    """``VocabParallelLMHead1D`` factory that keeps an LM head tied to its embedding.

    The sharder replaces the word embedding first (a new, sharded Parameter); when the native
    head's weight was the native embedding weight, the head is pointed at the sharded one
    before it is built, so ``VocabParallelLMHead1D`` reuses it and the two stay one Parameter.
    """

    __name__ = "TiedVocabParallelLMHead"

    def __init__(self, policy: TPPolicy) -> None:
        self._policy = policy

    def from_native_module(
        self, module: nn.Module, process_group: Any, **kwargs: Any
    ) -> nn.Module:
        """Build the vocab-parallel head, re-tied to the sharded embedding when it was tied."""
        from colossal.shardformer.layer import VocabParallelLMHead1D

        policy = self._policy
        assert policy.model is not None
        native = policy._native_embedding_weight
        if native is not None and getattr(module, "weight", None) is native:
            emb = policy.model.get_input_embeddings()
            if emb.weight is not native:  # the embedding got a new (sharded) Parameter
                module.weight = emb.weight
        if not isinstance(module, nn.Linear):
            raise TypeError(f"the LM head must be an nn.Linear, got {type(module).__name__}")
        new = VocabParallelLMHead1D.from_native_module(module, process_group, **kwargs)
        policy.after_lm_head(module, new)
        return new

    def __repr__(self) -> str:
        return "TiedVocabParallelLMHead(VocabParallelLMHead1D)"


def install_masked_lm_loss(model: nn.Module, process_group: Any, vocab_size: int) -> None:
    """Compute a masked-LM loss (no label shift) on vocab-sharded logits, through hooks.

    Models such as ``BertForMaskedLM`` compute ``CrossEntropyLoss`` inline on full-vocabulary
    logits. A forward pre-hook takes ``labels`` out of the call (so the model computes no
    loss) and a forward hook puts back ``loss = cross_entropy_1d(logits, labels)`` as the
    first field of the output, as the model would have. Idempotent.

    Args:
        model: The model whose ``forward`` takes ``labels`` and returns ``logits``.
        process_group: The tensor-parallel group the logits are sharded over.
        vocab_size: The real vocabulary size (padding columns are excluded).
    """
    if getattr(model, "_colossal_masked_lm_loss", None) is not None:
        return
    from colossal.shardformer.layer import cross_entropy_1d

    pending: list[torch.Tensor | None] = []

    def take_labels(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pending.append(kwargs.pop("labels", None))
        return args, kwargs

    def add_loss(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        labels = pending.pop()
        if labels is None:
            return output
        logits = output[0] if isinstance(output, tuple) else output.logits
        loss = cross_entropy_1d(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1).to(logits.device),
            process_group,
            vocab_size=vocab_size,
        )
        if isinstance(output, tuple):
            return (loss, *output)
        fields = {k: v for k, v in output.items() if k != "loss"}
        return type(output)(loss=loss, **fields)

    handles = (
        model.register_forward_pre_hook(take_labels, with_kwargs=True),
        model.register_forward_hook(add_loss, with_kwargs=True),
    )
    model._colossal_masked_lm_loss = handles  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module


def dropout_descriptions(
    suffixes: list[str], *, parallel: bool = False
) -> list[SubModuleReplacementDescription]:
    """Seeded dropout replacements (replicated input unless ``parallel``), skipped if absent."""
    from colossal.shardformer.layer import DropoutForParallelInput, DropoutForReplicatedInput

    target = DropoutForParallelInput if parallel else DropoutForReplicatedInput
    return [
        SubModuleReplacementDescription(suffix=s, target_module=target, ignore_if_not_exist=True)
        for s in suffixes
    ]


def col(suffix: str, **kwargs: Any) -> SubModuleReplacementDescription:
    """A column-parallel ``nn.Linear`` replacement."""
    from colossal.shardformer.layer import Linear1D_Col

    return SubModuleReplacementDescription(suffix=suffix, target_module=Linear1D_Col, kwargs=kwargs)


def row(suffix: str, **kwargs: Any) -> SubModuleReplacementDescription:
    """A row-parallel ``nn.Linear`` replacement."""
    from colossal.shardformer.layer import Linear1D_Row

    return SubModuleReplacementDescription(suffix=suffix, target_module=Linear1D_Row, kwargs=kwargs)

