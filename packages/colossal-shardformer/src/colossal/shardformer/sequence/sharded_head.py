"""The causal-LM head and loss on this rank's tokens (``all_to_all`` / ``ring_attn``).

In the ``"attention"`` sequence-parallel modes the layers run on sequence shards. For a
causal LM with ``parallel_output=True`` (logits stay split: over the vocabulary under tensor
parallelism and, here, over the sequence) the LM head and the loss run on this rank's tokens
too, as PyTorch's ``context_parallel`` does: nobody computes ``b * s * V`` logits.

Two ways to get the head onto local tokens, chosen from data:

* ``"local_exit"``: the model's own pipeline plan (transformers' ``_pp_plan``) lists the
  layer stack and the modules after it as plain ``hidden_states -> hidden_states`` modules
  (Llama, Qwen2, ...): the stack's exit does not gather, and the final norm and the head run
  on local tokens.
* ``"split_head"``: otherwise (hand-written policies: GPT-2 reshapes the stack's output to
  the input's sequence length, OPT, BERT's LM head): the stack's exit gathers as before and
  a pre-hook on the LM head keeps this rank's tokens of its input, so only the (dominant)
  head and loss run on local tokens.

Parameters applied to local tokens only (the final norm in ``"local_exit"``, the LM head)
get partial gradients and are marked for
:class:`~colossal.shardformer.sequence.grad_sync.SequenceParallelGradSync`. An LM head tied
to the input embedding (GPT-2, Qwen2) is one Parameter whose embedding part of the gradient
is whole on every rank: a hook scales the embedding's gradient by ``1 / P`` so the sync's sum
is exact.

The model's ``loss_function`` (transformers' ``ForCausalLMLoss`` or the vocab-parallel
``causal_lm_loss_fn`` under tensor parallelism) is wrapped by
:func:`sequence_parallel_causal_loss`: the full labels are shifted once, this rank's shifted
labels taken at the layout's token indices, the local sum divided by the whole batch's token
count (or ``num_items_in_batch``), and the result summed over the group in forward with an
identity backward: the returned loss is the global loss on every rank and each rank
back-propagates its own tokens' share. When the wrapped loss is transformers' own
``ForCausalLMLoss``, the local loss is computed by :func:`colossal.kernels.cross_entropy`
instead (same result): it saves the logits and a per-row log-sum-exp for the backward, not
``F.cross_entropy``'s float32 log-probabilities, one ``(tokens / P, V)`` tensor less at the
step's peak.

The returned ``logits`` are this rank's tokens, ``(batch, seq / P[, V / tp])``, in layout
order (:func:`~colossal.shardformer.sequence.layout.token_indices`). A forward with a nonzero
``logits_to_keep`` gathers as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core.comm import all_reduce
from colossal.kernels import cross_entropy
from colossal.shardformer.layer._primitives import scale_grad
from colossal.shardformer.sequence.grad_sync import mark_partial_grad, partial_grad_group
from colossal.shardformer.sequence.layout import split_sequence, token_indices
from colossal.shardformer.sequence.stack_hooks import SequenceParallelState

if TYPE_CHECKING:
    from colossal.shardformer.policies.base_policy import Policy
    from colossal.shardformer.shard.config import ShardConfig

__all__ = [
    "HEAD_MODES",
    "install_sharded_head",
    "install_tied_embedding_grad_scale",
    "sharded_head_mode",
    "sequence_parallel_causal_loss",
]

logger = logging.getLogger(__name__)

HEAD_MODES = ("local_exit", "split_head")
"""How :func:`install_sharded_head` puts the LM head on local tokens (see the module doc)."""

_MISSING = object()
_CAUSAL_LOSS_TYPES = (None, "ForCausalLM")  # None: transformers' default loss is causal


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group in forward; identity backward (each rank keeps its share)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _output_head(model: nn.Module) -> nn.Module | None:
    """The real (not a pipeline placeholder) output embedding of ``model``, or None."""
    from colossal.shardformer.pipeline.placeholders import is_placeholder

    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, nn.Module) or is_placeholder(head):
        return None
    return head


def _is_causal_lm(model: nn.Module, policy: Any) -> bool:
    """Whether ``model``'s loss is the causal LM loss computed through ``loss_function``."""
    if not hasattr(type(model), "loss_function"):
        return False
    declared = getattr(policy, "loss", _MISSING)  # hand-written policies say it
    if declared is not _MISSING:
        return declared == "causal"
    return getattr(model, "loss_type", None) in _CAUSAL_LOSS_TYPES


def _post_stack_modules(model: nn.Module, stack_path: str) -> list[nn.Module] | None:
    """Modules the model's ``_pp_plan`` runs after ``stack_path`` (None: no usable plan)."""
    from colossal.shardformer.pipeline.placeholders import is_placeholder, resolve_path

    plan = getattr(model, "_pp_plan", None)
    if not isinstance(plan, dict) or stack_path not in plan:
        return None
    after: list[nn.Module] = []
    for path, spec in plan.items():
        if path == stack_path:
            continue
        inputs = spec[0] if isinstance(spec, (tuple, list)) and spec else ()
        if list(inputs) != ["hidden_states"]:
            continue  # embeddings and the like run before the stack
        module = resolve_path(model, path)
        if isinstance(module, nn.Module) and not is_placeholder(module):
            after.append(module)
    return after


def sharded_head_mode(
    model: nn.Module, config: ShardConfig, stack_path: str, policy: Policy | None = None
) -> str | None:
    """How ``model``'s LM head runs on local tokens, or None to keep today's exit gather.

    None unless: the group kind is ``"attention"``, ``config.parallel_output`` is True, this
    model (or pipeline chunk) holds a real output embedding, and its loss is the causal LM
    loss through ``loss_function`` (the policy's ``loss == "causal"``, else transformers'
    ``loss_type``). Then ``"local_exit"`` when the model's ``_pp_plan`` lists the modules
    after the stack, else ``"split_head"``.

    Args:
        model: The model or pipeline chunk.
        config: The shard config.
        stack_path: The layer stack's dotted path (``find_layer_stack(model)[0]``).
        policy: The policy sharding the model (its ``loss`` attribute, when it has one).
    """
    if config.sequence_parallel_group_kind != "attention" or not config.parallel_output:
        return None
    if _output_head(model) is None or not _is_causal_lm(model, policy):
        return None
    return "split_head" if _post_stack_modules(model, stack_path) is None else "local_exit"


def _is_transformers_causal_loss(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is transformers' default causal LM loss (``ForCausalLMLoss``)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # an older transformers without the loss module
        return False
    return fn is ForCausalLMLoss


def _lean_causal_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int,
    ignore_index: int,
) -> torch.Tensor:
    """``ForCausalLMLoss`` on shifted labels (float32, sum / ``num_items_in_batch``), lean.

    :func:`colossal.kernels.cross_entropy` computes in float32 as ``logits.float()`` does and
    saves no log-probabilities (nor a float32 copy of half-precision logits).
    """
    return cross_entropy(
        logits, shift_labels.to(logits.device), ignore_index=ignore_index,
        reduction="mean", divisor=num_items_in_batch,
    )  # fmt: skip


def sequence_parallel_causal_loss(
    inner: Callable[..., torch.Tensor], state: SequenceParallelState
) -> Callable[..., torch.Tensor]:
    """``inner`` (a causal LM ``loss_function``) computed on this rank's tokens' logits.

    The returned callable has transformers' signature ``(logits, labels, vocab_size,
    num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs)``. With
    ``logits`` of this rank's ``seq / P`` tokens (layout order) and the full ``labels``, it
    shifts the labels once, keeps this rank's shifted labels, and calls ``inner`` with them
    as ``shift_labels`` and ``num_items_in_batch`` set to the whole batch's count of
    non-ignored labels (or the caller's), then sums over the group (identity backward).
    Full-length logits go to ``inner`` unchanged. When ``inner`` is transformers'
    ``ForCausalLMLoss``, the local loss is :func:`colossal.kernels.cross_entropy` with the
    same semantics (float32, ``ignore_index``, divided by ``num_items_in_batch``), which keeps
    no log-probabilities for the backward.

    Args:
        inner: The loss function to wrap; it must accept ``shift_labels`` and
            ``num_items_in_batch`` (transformers' ``ForCausalLMLoss``, ``causal_lm_loss_fn``).
        state: The sequence-parallel state (group, layout, rank, size).

    Raises:
        ValueError: The logits hold neither the whole sequence nor this rank's share of it.
    """
    lean = _is_transformers_causal_loss(inner)

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            if labels is None:
                raise ValueError("the causal LM loss needs labels or shift_labels, got neither")
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        seq_len = int(shift_labels.shape[-1])
        local_len = int(logits.shape[-2])
        if state.size == 1 or local_len == seq_len:
            return inner(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )  # fmt: skip
        if local_len * state.size != seq_len:
            raise ValueError(
                f"sequence-parallel loss: logits hold {local_len} tokens, but the labels have "
                f"{seq_len} and the group {state.size} ranks; pass this rank's logits of the "
                "whole sequence (seq / P tokens)"
            )
        index = token_indices(seq_len, state.rank, state.size, state.layout, shift_labels.device)
        local = shift_labels.index_select(-1, index).contiguous()
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != ignore_index).sum()
        if lean and int(logits.shape[-1]) == int(vocab_size):
            loss = _lean_causal_loss(logits, local, num_items_in_batch, ignore_index)
        else:
            loss = inner(
                logits, local, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=local, **kwargs,
            )  # fmt: skip
        return _SumOverGroup.apply(loss, state.group)

    loss_function.__wrapped__ = inner  # type: ignore[attr-defined]
    return loss_function


def _keeps_all_logits(kwargs: dict[str, Any]) -> bool:
    keep = kwargs.get("logits_to_keep", 0)
    return keep is None or (isinstance(keep, int) and keep == 0)


def install_sharded_head(
    model: nn.Module,
    state: SequenceParallelState,
    mode: str,
    stack_path: str,
) -> None:
    """Run ``model``'s LM head and loss on this rank's tokens (see the module doc).

    Call after :func:`~colossal.shardformer.sequence.stack_hooks.install_stack_hooks`.

    Args:
        model: The causal LM (or the pipeline chunk holding its head).
        state: Its sequence-parallel state.
        mode: ``"local_exit"`` or ``"split_head"`` (:func:`sharded_head_mode`).
        stack_path: The layer stack's dotted path.

    Raises:
        ValueError: Unknown ``mode``.
        TypeError: The model has no output embedding.
    """
    if mode not in HEAD_MODES:
        raise ValueError(f"sharded head mode must be one of {HEAD_MODES}, got {mode!r}")
    head = _output_head(model)
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embedding to run on local tokens")
    group = state.group
    state.local_exit = mode == "local_exit"

    def start(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.local_head = _keeps_all_logits(kwargs)

    def finish(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        state.local_head = False

    state.handles.append(model.register_forward_pre_hook(start, with_kwargs=True))
    state.handles.append(model.register_forward_hook(finish, with_kwargs=True, always_call=True))

    partial: list[nn.Module] = [head]
    if mode == "local_exit":
        partial = [*(_post_stack_modules(model, stack_path) or []), head]
    else:

        def split_input(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            if not state.local_head or not args or not isinstance(args[0], torch.Tensor):
                return None
            return (split_sequence(args[0], group, state.layout), *args[1:])

        state.handles.append(head.register_forward_pre_hook(split_input))
    marked = 0
    for module in partial:
        for param in module.parameters():
            mark_partial_grad(param, group)
            marked += 1
    model.loss_function = sequence_parallel_causal_loss(model.loss_function, state)  # type: ignore[assignment, arg-type]  # torch's stub: Module attrs are Tensor | Module
    logger.info(
        "%s: LM head and loss on this rank's tokens (%s, %d parameters with partial gradients)",
        type(model).__name__,
        mode,
        marked,
    )


def install_tied_embedding_grad_scale(model: nn.Module, state: SequenceParallelState) -> None:
    """Scale the input embedding's gradient by ``1 / P`` when its weight is marked partial.

    Installed on every model chunk in the ``"attention"`` modes. The weight is marked when
    an LM head holding it runs on local tokens (a tied head, on this chunk or on another
    chunk of the same stage); the embedding's own part of the gradient is whole on every
    rank, so the sync's sum would count it ``P`` times. Checked per forward: the head may be
    marked after this chunk was prepared.
    """
    from colossal.shardformer.pipeline.placeholders import is_placeholder

    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        emb = None
    if not isinstance(emb, nn.Module) or is_placeholder(emb):
        return
    if getattr(emb, "_colossal_tied_grad_scale", False):
        return

    def scale(mod: nn.Module, args: Any, output: Any) -> Any:
        weight = getattr(mod, "weight", None)
        marked, _ = partial_grad_group(weight) if weight is not None else (False, None)
        if not marked or state.size == 1 or not isinstance(output, torch.Tensor):
            return None
        return scale_grad(output, 1.0 / state.size)

    state.handles.append(emb.register_forward_hook(scale))
    emb._colossal_tied_grad_scale = True  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module
