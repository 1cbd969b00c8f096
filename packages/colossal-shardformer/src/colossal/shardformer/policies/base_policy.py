"""Policies as data: what to replace, what to divide, what is shared; never a model forward.

A :class:`Policy` describes how to shard one model family. :meth:`Policy.module_policy`
maps a module class (``LlamaDecoderLayer``) to a :class:`ModulePolicyDescription` that says,
for every instance of that class:

* ``sub_module_replacement``: which submodules (by dotted suffix relative to the instance)
  become which parallel layer, built with ``target_module.from_native_module(native,
  process_group, **kwargs)``;
* ``attribute_replacement``: which attributes to set (a head count divided by the
  tensor-parallel size), by dotted name relative to the instance;
* ``tp_region_inputs``: submodules whose hidden-state input enters the tensor-parallel region
  once (Megatron's ``f``: identity forward, one all-reduce of the gradient backward), so
  several column-parallel projections reading that input (q, k and v) share one all-reduce.

The sharder applies the descriptions; the attention itself runs through transformers' own
``AttentionInterface``, and the loss through the model's ``loss_function``. The method names
follow ColossalAI's ``Policy`` so its users recognize them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from colossal.shardformer.grid.plan import GridPlan
    from colossal.shardformer.pipeline.manager import StageManagerLike
    from colossal.shardformer.pipeline.plan import StagePlan
    from colossal.shardformer.shard.config import ShardConfig

__all__ = [
    "ModulePolicyDescription",
    "Policy",
    "SubModuleReplacementDescription",
]


@dataclass(frozen=True)
class SubModuleReplacementDescription:
    """One submodule to replace with a parallel layer.

    Attributes:
        suffix: Dotted path of the submodule relative to the module the description is for
            (``"self_attn.q_proj"``).
        target_module: The replacement's class; built with ``target_module.from_native_module(
            native, process_group, **kwargs)``.
        kwargs: Extra keyword arguments for ``from_native_module``.
        ignore_if_not_exist: Skip silently when the submodule is absent (else an error).
    """

    suffix: str
    target_module: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    ignore_if_not_exist: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.suffix, str) or not self.suffix:
            raise ValueError(f"suffix must be a non-empty dotted name, got {self.suffix!r}")
        if not callable(getattr(self.target_module, "from_native_module", None)):
            raise TypeError(
                f"target_module {self.target_module!r} for {self.suffix!r} has no "
                "from_native_module(module, process_group, **kwargs) classmethod"
            )


@dataclass
class ModulePolicyDescription:
    """How to shard every instance of one module class.

    Attributes:
        attribute_replacement: Dotted attribute name (relative to the instance) -> new value.
        sub_module_replacement: Submodules to replace with parallel layers, in order.
        tp_region_inputs: Dotted suffixes of submodules (``""`` for the instance itself)
            whose hidden-state input enters the tensor-parallel region once, shared by the
            column-parallel projections inside them.
    """

    attribute_replacement: dict[str, Any] = field(default_factory=dict)
    sub_module_replacement: list[SubModuleReplacementDescription] = field(default_factory=list)
    tp_region_inputs: list[str] = field(default_factory=list)


PolicyMap = dict[type[nn.Module] | str, ModulePolicyDescription]
"""Module class (or its name) -> how to shard its instances."""


class Policy(ABC):
    """How to shard one model family; subclasses describe it as data.

    The sharder calls, in order: :meth:`set_model`, :meth:`set_shard_config`,
    :meth:`config_sanity_check`, :meth:`preprocess`, applies :meth:`module_policy`, then
    :meth:`postprocess` (which installs the attention implementation and the vocab-parallel
    loss where the policy asks for them).
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.shard_config: ShardConfig | None = None

    def set_model(self, model: nn.Module) -> None:
        """The model being sharded (its config is ``self.model.config``)."""
        self.model = model

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        """The sharding options."""
        self.shard_config = shard_config

    @property
    def tp_size(self) -> int:
        """The tensor-parallel size (1 when tensor parallelism is off).

        In a grid mode (``"2d"``, ``"2.5d"``, ``"3d"``) the number of parts the hidden dim
        and the attention heads are split into, ``q``: what head counts must divide by.
        """
        assert self.shard_config is not None, "set_shard_config first"
        if not self.shard_config.enable_tensor_parallelism:
            return 1
        if getattr(self.shard_config, "is_grid_mode", False) and dist.is_initialized():
            # heads and widths are split over the grid's q hidden parts (see grid_plan)
            return self.shard_config.grid_dims().tp_grid_shape[-1]
        return self.shard_config.tensor_parallel_size

    @property
    def pipeline_stage_manager(self) -> StageManagerLike | None:
        """The pipeline stage manager of the shard config (None without pipelining)."""
        return None if self.shard_config is None else self.shard_config.pipeline_stage_manager

    def config_sanity_check(self) -> None:
        """Raise ValueError when the model's config cannot be sharded as asked (default: ok)."""
        return None

    def preprocess(self) -> nn.Module:
        """Adjust the model before sharding (default: as it is)."""
        assert self.model is not None
        return self.model

    @abstractmethod
    def module_policy(self) -> PolicyMap:
        """Module class -> how to shard its instances."""

    def postprocess(self) -> nn.Module:
        """Adjust the model after sharding (default: as it is)."""
        assert self.model is not None
        return self.model

    def grid_plan(self) -> GridPlan:
        """How the 2D / 2.5D / 3D modes shard the model's transformer blocks.

        Raises:
            NotImplementedError: The policy has no grid plan (default).
        """
        mode = None if self.shard_config is None else self.shard_config.tensor_parallel_mode
        raise NotImplementedError(
            f"{type(self).__name__} has no grid_plan() for tensor_parallel_mode={mode!r}; "
            "implement Policy.grid_plan() returning a colossal.shardformer.grid.GridPlan, or "
            "use tensor_parallel_mode='1d'"
        )

    def get_shared_params(self) -> list[dict[int, torch.Tensor]]:
        """Parameters shared between pipeline stages, as ``{stage: param}`` (default: none)."""
        return []

    def stage_plan(self) -> StagePlan:
        """How pipeline parallelism cuts the model into stages (default: derived).

        The default derives the plan from the model config's ``base_model_pp_plan``; families
        without one override this with a written :class:`~colossal.shardformer.pipeline.
        StagePlan`.

        Raises:
            ValueError: The model has no ``base_model_pp_plan`` to derive a plan from.
        """
        from colossal.shardformer.pipeline.plan import derive_stage_plan

        assert self.model is not None
        return derive_stage_plan(self.model)

    def get_held_layers(self) -> list[nn.Module]:
        """Layers this pipeline stage holds (default: the whole model)."""
        assert self.model is not None
        return [self.model]

    @staticmethod
    def append_or_create_submodule_replacement(
        description: SubModuleReplacementDescription | list[SubModuleReplacementDescription],
        policy: PolicyMap,
        target_key: type[nn.Module] | str,
    ) -> PolicyMap:
        """Add submodule replacements for ``target_key`` to ``policy`` (ColossalAI's helper)."""
        items = description if isinstance(description, list) else [description]
        policy.setdefault(target_key, ModulePolicyDescription()).sub_module_replacement.extend(
            items
        )
        return policy

