"""Cut a model into this rank's pipeline chunks (shallow copies holding only their part)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar, overload

import torch
from torch import nn

from colossal.shardformer.pipeline.held_layers import HeldLayers
from colossal.shardformer.pipeline.manager import StageManagerLike
from colossal.shardformer.pipeline.placeholders import StagePlaceholder
from colossal.shardformer.pipeline.plan import StagePlan, base_model_of
from colossal.shardformer.pipeline.stage import StageForward

if TYPE_CHECKING:
    from colossal.shardformer.policies.base_policy import Policy
    from colossal.shardformer.shard.config import ShardConfig

_T = TypeVar("_T")

__all__ = ["SharedParameter", "shallow_copy", "split_into_stages", "stage_layer_ranges"]

logger = logging.getLogger(__name__)


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new instance sharing ``module``'s children, parameters and attributes.

    The registries (``_modules``, ``_parameters``, ``_buffers``, hook dicts) are copied, so
    replacing a child or registering a hook on the copy leaves ``module`` as it was; no
    tensor is touched (meta tensors stay meta).
    """
    new = type(module).__new__(type(module))
    state = dict(module.__dict__)
    for key, value in state.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            state[key] = type(value)(value) if not isinstance(value, dict) else value.copy()
    new.__dict__.update(state)
    return new


def _replace_path(root: nn.Module, dotted: str, new: nn.Module) -> None:
    """Set ``root.<dotted>`` to ``new``, shallow-copying every module on the way."""
    *path, leaf = dotted.split(".")
    parent = root
    for part in path:
        child = parent._modules[part]
        assert child is not None
        copied = shallow_copy(child)
        parent._modules[part] = copied
        parent = copied
    parent._modules[leaf] = new


def _lookup(root: nn.Module, dotted: str) -> nn.Module | None:
    current: nn.Module | None = root
    for part in dotted.split("."):
        if current is None:
            return None
        current = current._modules.get(part)
    return current


def stage_layer_ranges(manager: StageManagerLike, num_layers: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer range of each chunk of this stage, checked.

    Raises:
        ValueError: A slice with no layer, or counts that do not sum to ``num_layers``,
            naming the counts.
    """
    counts = list(manager.distribute_layers(num_layers))
    if sum(counts) != num_layers:
        raise ValueError(
            f"layers per pipeline slice {counts} sum to {sum(counts)}, but the model has "
            f"{num_layers} layers; give num_layers_per_stage that sums to {num_layers}"
        )
    if any(c < 1 for c in counts):
        raise ValueError(
            f"layers per pipeline slice {counts} leave a slice without layers; every one of "
            f"the {len(counts)} slices (stages x chunks) needs at least one of the "
            f"{num_layers} layers"
        )
    ranges = manager.get_stage_index(counts)
    return [ranges] if isinstance(ranges, tuple) else list(ranges)


def check_layer_types(model: nn.Module, base: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """Refuse a split the base model's forward would give the wrong per-layer masks.

    Some forwards pick each layer's mask as ``mask_mapping[config.layer_types[i]]`` with
    ``i`` counted from 0 over the layers they hold; on a stage starting at layer ``s`` that
    is layer ``s + i``'s type only when the types repeat with that offset.

    Raises:
        NotImplementedError: A held layer whose type differs from the one the forward would
            use, naming the layers and how to split instead.
    """
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    config = getter() if callable(getter) else config
    types = list(getattr(config, "layer_types", None) or [])
    if len(set(types)) <= 1:
        return
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return
    if "layer_types[i]" not in source:
        return  # the forward reads each layer's own attention type
    for start, end in ranges:
        wrong = [start + i for i in range(end - start) if types[start + i] != types[i]]
        if wrong:
            raise NotImplementedError(
                f"{type(model).__name__}: its forward picks layer masks by local index "
                f"(config.layer_types[i]); a stage holding layers [{start}, {end}) would give "
                f"layers {wrong} the mask of another attention type ({types}). Choose "
                "num_layers_per_stage so every slice starts at a multiple of the type pattern"
            )


class SharedParameter(dict):
    """``{stage: parameter}`` of one parameter tied across stages, always current.

    Values are looked up on the model chunks when read, so a parameter the tensor-parallel
    sharding replaced after the split is reported as its sharded replacement. Stages this
    rank does not hold map to ``None`` (as :class:`colossal.pipeline.SharedParamGradSync`
    expects).
    """

    def __init__(self, where: dict[int, tuple[nn.Module, str] | None]) -> None:
        super().__init__({stage: None for stage in where})
        self._where = where
        for stage in where:
            super().__setitem__(stage, self._resolve(stage))

    def _resolve(self, stage: int) -> torch.Tensor | None:
        entry = self._where.get(stage)
        if entry is None:
            return None
        chunk, dotted = entry
        module_path, _, name = dotted.rpartition(".")
        module = chunk.get_submodule(module_path) if module_path else chunk
        value = getattr(module, name)
        super().__setitem__(stage, value)
        return value

    def __getitem__(self, stage: int) -> torch.Tensor | None:
        if stage not in self._where:
            raise KeyError(stage)
        return self._resolve(stage)

    @overload
    def get(self, stage: int, default: None = None) -> torch.Tensor | None: ...

    @overload
    def get(self, stage: int, default: _T) -> torch.Tensor | _T | None: ...

    def get(self, stage: int, default: object = None) -> object:
        """The parameter of ``stage`` (``default`` when no stage shares it)."""
        return self._resolve(stage) if stage in self._where else default

    def values(self) -> list[torch.Tensor | None]:  # type: ignore[override]
        """The current parameters (``None`` for stages not on this rank)."""
        return [self._resolve(s) for s in self._where]

    def items(self) -> list[tuple[int, torch.Tensor | None]]:  # type: ignore[override]
        """``(stage, current parameter)`` pairs."""
        return [(s, self._resolve(s)) for s in self._where]

    def __iter__(self) -> Iterator[int]:
        return iter(self._where)


def _tied_weight_paths(model: nn.Module, base_path: str, plan: StagePlan) -> tuple[str, str] | None:
    """``(embedding weight, head weight)`` names when the output embedding is tied to the input."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return None
    emb, head = get_in(), get_out()
    if emb is None or head is None or getattr(head, "weight", None) is not emb.weight:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    return f"{names[id(emb)]}.weight", f"{names[id(head)]}.weight"


def _make_chunk(
    model: nn.Module,
    plan: StagePlan,
    base_path: str,
    layer_path: str,
    layers: nn.ModuleList,
    span: tuple[int, int],
    is_first: bool,
    is_last: bool,
    slice_index: int,
) -> nn.Module:
    chunk = shallow_copy(model)
    prefix = f"{base_path}." if base_path else ""
    start, end = span
    _replace_path(chunk, layer_path, HeldLayers((i, layers[i]) for i in range(start, end)))
    inputs: list[StagePlaceholder] = []
    owned: list[tuple[str, str]] = []
    if not is_first:
        owned += [(prefix + p, k) for p, k in plan.first.items()]
    if not is_last:
        owned += [(prefix + p, k) for p, k in plan.last.items()]
        if base_path:  # the head model's own modules (lm_head, score, classifier, ...)
            owned += [(name, "absent") for name in model._modules if name != base_path]
    for path, kind in owned:
        native = _lookup(model, path)
        if native is None:
            continue  # optional modules (OPT's project_in) may be None
        placeholder = StagePlaceholder(kind, path, type(native).__name__)
        probe = plan.dtype_probes.get(path[len(prefix) :]) if path.startswith(prefix) else None
        if probe is not None:
            placeholder.add_dtype_probe(probe, native.get_parameter(probe))
        _replace_path(chunk, path, placeholder)
        if kind == "input":
            inputs.append(placeholder)
    chunk._colossal_pipeline_slice = slice_index  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module
    chunk.forward = StageForward(chunk, plan, base_path, is_first, is_last, inputs)
    logger.debug(
        "%s slice %d: layers [%d, %d), placeholders %s",
        type(model).__name__,
        slice_index,
        start,
        end,
        [p for p, _ in owned],
    )
    return chunk


def split_into_stages(
    model: nn.Module, policy: Policy, config: ShardConfig
) -> tuple[list[nn.Module], list[dict[int, torch.Tensor | None]]]:
    """This rank's model chunks and the parameters tied across stages.

    Each chunk is a shallow copy of ``model`` (same class and config) holding only its
    layers (under their original indices) and placeholders where other stages' modules
    were; its instance ``forward`` is the stage forward (:class:`StageForward`). Nothing of
    a module this rank does not hold is read or copied.

    Args:
        model: The transformers model (not modified).
        policy: The family's policy (its ``stage_plan()``).
        config: The ``ShardConfig`` with ``pipeline_stage_manager``.

    Returns:
        ``(chunks, shared_params)``: one chunk per model chunk of this stage (chunk order);
        ``shared_params`` is ``[{first_stage: embedding weight, last_stage: head weight}]``
        when a tied input/output embedding ends up on two stages (``None`` for a stage this
        rank is not), else ``[]``.

    Raises:
        ValueError: A slice without layers or counts not summing to the layer count.
    """
    from colossal.shardformer.shard.stack import find_layer_stack

    manager = config.pipeline_stage_manager
    if manager is None:
        raise ValueError("split_into_stages needs a ShardConfig with a pipeline_stage_manager")
    plan: StagePlan = policy.stage_plan()
    base_path, _ = base_model_of(model)
    layer_path, layers = find_layer_stack(model)
    expected = f"{base_path}.{plan.layers}" if base_path else plan.layers
    if layer_path != expected:
        raise ValueError(
            f"{type(model).__name__}: the stage plan's layer stack {expected!r} is not the "
            f"model's layer stack {layer_path!r}; fix the policy's stage_plan()"
        )
    ranges = stage_layer_ranges(manager, len(layers))
    check_layer_types(model, base_model_of(model)[1], ranges)
    layout = manager.layout
    num_slices = layout.num_slices
    chunks = []
    for chunk_id, span in enumerate(ranges):
        v = layout.slice_of(manager.stage, chunk_id)
        chunks.append(
            _make_chunk(
                model, plan, base_path, layer_path, layers, span, v == 0, v == num_slices - 1, v
            )
        )
    shared: list[dict[int, torch.Tensor | None]] = []
    tied = _tied_weight_paths(model, base_path, plan)
    first_stage, last_stage = layout.locate(0)[0], layout.locate(num_slices - 1)[0]
    if tied is not None and first_stage != last_stage:
        emb_name, head_name = tied
        where: dict[int, tuple[nn.Module, str] | None] = {first_stage: None, last_stage: None}
        for chunk_id, chunk in enumerate(chunks):
            v = layout.slice_of(manager.stage, chunk_id)
            if v == 0:
                where[first_stage] = (chunk, emb_name)
            if v == num_slices - 1:
                where[last_stage] = (chunk, head_name)
        shared.append(SharedParameter(where))
    return chunks, shared
