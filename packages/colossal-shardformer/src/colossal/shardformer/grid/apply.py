"""Apply a grid mode (2D, 2.5D, 3D) to a model's transformer blocks, as a :class:`GridPlan` says.

Where the cut lies (and why): the grid modes partition the activation on the batch *and* the
hidden dim, so every per-sample tensor a block reads must be split the same way. Inside the
blocks every linear layer, norm and dropout becomes the mode's layer; outside them
(embeddings, final norm, heads, the loss) the model stays as it is, replicated and whole on
every rank of the grid. A forward pre-hook on the first block splits the hidden state into
this rank's part (backward: the gradient is gathered whole, so the replicated embeddings get
their whole gradient on every rank), and a hook after the last block gathers it (backward:
each rank keeps its part). So the model's own masks, losses and heads run unchanged, and
checkpoints keep Hugging Face's names; the replicated ends cost ``tp`` times their compute,
which for small embeddings and heads is cheap next to the blocks (a vocabulary-parallel head
in the mode's layers is left for later).

Every block also gets a pre-hook that splits the per-sample arguments it is given
(``attention_mask``, ``position_ids``, the rotary ``position_embeddings``, ...) into the rows
of attention's layout (3D runs attention in the cube's swapped orientation); an argument whose
dim 0 is 1 broadcasts and stays.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import shard_spec
from colossal.shardformer.grid.layers import GridConv1D, GridRootMeanSquareNorm, is_rms_norm
from colossal.shardformer.grid.modes import GridMode
from colossal.shardformer.grid.plan import GridPlan
from colossal.shardformer.shard.sharder import (
    ShardSummary,
    _check_parameters,
    _tied_groups,
    get_submodule,
    set_attribute,
)

__all__ = ["apply_grid_parallelism", "check_grid_plan"]

logger = logging.getLogger(__name__)


def check_grid_plan(model_name: str, plan: GridPlan, mode: GridMode) -> None:
    """Raise ValueError unless the plan's widths and head counts divide the grid (no collectives).

    Raises:
        ValueError: Naming the dimension, its size, the divisor and the grid.
    """
    parts, how = mode.width_parts
    for name, size in plan.widths.items():
        if size % parts:
            raise ValueError(
                f"{model_name}: {name} {size} is not divisible by {how}={parts} for "
                f"tensor_parallel_mode={mode.name!r} ({mode.describe()}); choose a {name} "
                f"divisible by {parts}, or another tensor_parallel_mode or size"
            )
    for name, count in plan.head_counts.items():
        if count % mode.q:
            raise ValueError(
                f"{model_name}: {name} {count} is not divisible by q={mode.q} for "
                f"tensor_parallel_mode={mode.name!r} ({mode.describe()}): the attention heads "
                "are split across the hidden dim's q parts; choose a head count divisible by "
                f"{mode.q}, or another tensor_parallel_mode or size"
            )


def _replace(block: nn.Module, suffix: str, new: nn.Module) -> None:
    parent_path, _, name = suffix.rpartition(".")
    parent = get_submodule(block, parent_path)
    assert parent is not None
    setattr(parent, name, new)


def _require(block: nn.Module, path: str, suffix: str) -> nn.Module:
    native = get_submodule(block, suffix)
    if native is None:
        raise ValueError(
            f"{type(block).__name__} at {path!r} has no submodule {suffix!r} named by the "
            "policy's grid_plan(); fix the plan"
        )
    return native


def _linear(native: nn.Module, role: str, n_fused: int, mode: GridMode) -> nn.Module:
    if type(native).__name__ == "Conv1D":
        return GridConv1D(native, mode, role, n_fused)
    if isinstance(native, nn.Linear):
        if n_fused != 1:
            raise NotImplementedError(
                f"fused nn.Linear projections (n_fused={n_fused}) are not supported in the grid "
                "modes; list the projections separately"
            )
        return mode.linear(native, role)
    raise TypeError(f"expected an nn.Linear or a Conv1D, got {type(native).__name__}")


def _norm(native: nn.Module, mode: GridMode) -> nn.Module:
    if isinstance(native, nn.LayerNorm):
        return mode.layer_norm(native)
    if is_rms_norm(native):
        return GridRootMeanSquareNorm(native, mode)
    raise NotImplementedError(
        f"{type(native).__name__} is neither an nn.LayerNorm nor a Llama-style RMSNorm; the grid "
        "modes cannot shard it (write a policy whose grid_plan() leaves it out)"
    )


def _shard_block(
    block: nn.Module, path: str, plan: GridPlan, mode: GridMode, summary: ShardSummary
) -> None:
    from colossal.shardformer.policies.tp_plan import ReplicatedGradAllReduce

    jobs: list[tuple[str, Any]] = [
        *(
            (s, lambda m, r=r, s=s: _linear(m, r, plan.fused.get(s, 1), mode))
            for s, r in plan.linears.items()
        ),
        *((s, lambda m: _norm(m, mode)) for s in plan.norms),
    ]
    for suffix, build in jobs:
        native = _require(block, path, suffix)
        try:
            new = build(native)
        except ValueError as exc:
            raise ValueError(
                f"{path}.{suffix} ({type(native).__name__}) cannot be split for "
                f"tensor_parallel_mode={mode.name!r} ({mode.describe()}): {exc}"
            ) from exc
        _replace(block, suffix, new)
        summary.replaced[f"{path}.{suffix}"] = type(new).__name__
    tp_group = mode.dims.group("tp")
    for suffix in plan.replicated_grad:
        found = get_submodule(block, suffix)
        if found is not None:
            ReplicatedGradAllReduce.from_native_module(found, tp_group)
            summary.replaced[f"{path}.{suffix}"] = "ReplicatedGradAllReduce"
    for attr, value in plan.heads.items():
        set_attribute(block, attr, value // mode.q)
        summary.attributes.append(f"{path}.{attr}")
    for name, module in list(block.named_modules()):
        if type(module) is nn.Dropout:
            new = mode.dropout(module.p, module.inplace)
            _replace(block, name, new)
            summary.replaced[f"{path}.{name}"] = type(new).__name__


@dataclass
class _ForwardState:
    """The whole batch size of the forward in flight (set by the first block)."""

    batch: int | None = None


def _split_batch(value: Any, state: _ForwardState, mode: GridMode) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() > 0 and value.shape[0] == state.batch:
            return mode.split_attention_batch(value)
        return value
    if isinstance(value, tuple | list):
        return type(value)(_split_batch(v, state, mode) for v in value)
    return value


def _check_batch(batch: int, mode: GridMode) -> None:
    if batch % mode.batch_parts:
        raise ValueError(
            f"batch size {batch} is not divisible by {mode.batch_how}={mode.batch_parts} for "
            f"tensor_parallel_mode={mode.name!r} ({mode.describe()}): the grid splits the "
            f"batch {mode.batch_parts} ways; use a per-replica batch that is a multiple of "
            f"{mode.batch_parts}"
        )


class _BlockHooks:
    """The hooks of one block: split before it, gather after it.

    The pre-hook splits the hidden state (first block) and the per-sample arguments (every
    block); the post-hook gathers the hidden state (last block).
    """

    def __init__(
        self, block: nn.Module, plan: GridPlan, mode: GridMode, state: _ForwardState,
        first: bool, last: bool,
    ) -> None:  # fmt: skip
        params = inspect.signature(block.forward).parameters
        self.names = [
            n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.plan, self.mode, self.state = plan, mode, state
        self.first, self.last = first, last
        block.register_forward_pre_hook(self.pre, with_kwargs=True)
        if last:
            block.register_forward_hook(self.post)

    def pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Split the hidden state (first block) and the per-sample arguments."""
        items = list(args)
        if self.first:
            if items:
                hidden = items[0]
            else:
                hidden = kwargs["hidden_states"]
            _check_batch(int(hidden.shape[0]), self.mode)
            self.state.batch = int(hidden.shape[0])
            part = self.mode.split_hidden(hidden)
            if items:
                items[0] = part
            else:
                kwargs["hidden_states"] = part
        wanted = set(self.plan.batch_inputs)
        for i, value in enumerate(items):
            if i < len(self.names) and self.names[i] in wanted:
                items[i] = _split_batch(value, self.state, self.mode)
        for key in [k for k in kwargs if k in wanted]:
            kwargs[key] = _split_batch(kwargs[key], self.state, self.mode)
        return tuple(items), kwargs

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        """Gather the last block's hidden state whole."""
        if isinstance(output, torch.Tensor):
            return self.mode.gather_hidden(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (self.mode.gather_hidden(output[0]), *output[1:])
        raise TypeError(
            f"{type(module).__name__} returned {type(output).__name__}; the grid modes expect "
            "a block to return its hidden state (or a tuple starting with it)"
        )


def apply_grid_parallelism(
    model: nn.Module, plan: GridPlan, mode: GridMode, tp_group: ProcessGroup
) -> ShardSummary:
    """Shard ``model``'s transformer blocks in place with ``mode``'s layers.

    Args:
        model: The model (one whole model; pipeline stages are not supported here).
        plan: The policy's :class:`GridPlan`.
        mode: The grid mode and layout.
        tp_group: The whole grid's group (replicated dropouts outside the blocks draw alike
            over it).

    Returns:
        A :class:`~colossal.shardformer.shard.ShardSummary`.

    Raises:
        ValueError: A width, head count or layer that does not divide the grid (naming it).
        RuntimeError: Parameters were lost, added or untied.
    """
    from colossal.shardformer.layer import DropoutForReplicatedInput

    check_grid_plan(type(model).__name__, plan, mode)
    blocks = get_submodule(model, plan.layers)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(
            f"{type(model).__name__}: the grid plan's layers {plan.layers!r} is not a non-empty "
            "nn.ModuleList of transformer blocks; fix the policy's grid_plan()"
        )
    names_before = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied_before = _tied_groups(model)
    summary = ShardSummary()
    for i, block in enumerate(blocks):
        _shard_block(block, f"{plan.layers}.{i}", plan, mode, summary)
    inside = {id(m) for block in blocks for m in block.modules()}
    for name, module in list(model.named_modules()):
        if type(module) is nn.Dropout and id(module) not in inside:
            parent_path, _, attr = name.rpartition(".")
            parent = get_submodule(model, parent_path)
            assert parent is not None
            setattr(parent, attr, DropoutForReplicatedInput.from_native_module(module, tp_group))
            summary.replaced[name] = "DropoutForReplicatedInput"
    state = _ForwardState()
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        _BlockHooks(block, plan, mode, state, first=i == 0, last=i == last)
    _check_parameters(names_before, tied_before, model)
    summary.sharded_params = [n for n, p in model.named_parameters() if shard_spec(p) is not None]
    return summary
