"""ColossalAI's (FSDP1) ``TorchFSDPPlugin`` arguments, mapped onto FSDP2's ``fully_shard``.

ColossalAI documents ``TorchFSDPPlugin(process_group, sharding_strategy, cpu_offload,
auto_wrap_policy, backward_prefetch, mixed_precision, ignored_modules, param_init_fn,
sync_module_states)``, the arguments of ``FullyShardedDataParallel``. Colossal's plugin is
built on FSDP2, so each argument is translated here:

=======================  ===============================================================
FSDP1 argument           FSDP2 meaning
=======================  ===============================================================
``process_group``        the data-parallel group the device mesh is built from
``sharding_strategy``    ``FULL_SHARD``: ``reshard_after_forward=True``; ``SHARD_GRAD_OP``:
                         ``False``; ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: a 2-D
                         ``(replicate, shard)`` mesh with ``LOCAL_WORLD_SIZE`` ranks per
                         shard group; ``NO_SHARD``: refused (use ``TorchDDPPlugin``)
``cpu_offload``          ``CPUOffload(offload_params=True)``: ``CPUOffloadPolicy``
``auto_wrap_policy``     which submodules get their own ``fully_shard`` (FSDP1 policies and
                         ``callable(module, recurse, nonwrapped_numel)`` both work)
``backward_prefetch``    accepted; FSDP2 always prefetches the next all-gather in backward
``mixed_precision``      ``MixedPrecisionPolicy(param_dtype, reduce_dtype,
                         cast_forward_inputs)``; ``buffer_dtype``: floating-point buffers
                         are cast to it before sharding (FSDP2 leaves buffers alone)
``ignored_modules``      their parameters become ``fully_shard(ignored_params=...)``
``param_init_fn``        called on each module with meta-device tensors before sharding
``sync_module_states``   parameters and buffers broadcast from the group's rank 0 before
                         sharding
=======================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import _Policy
from torch.optim import Optimizer

from colossal.booster.plugin.base import (
    group_param_names,
    has_lazy_tensors,
    materialize_model,
    repoint_optimizer,
)
from colossal.core import ParallelDims, get_accelerator
from colossal.core.comm import broadcast
from colossal.lazy import is_lazy, lazy_to

logger = logging.getLogger(__name__)

__all__ = ["AutoWrapPolicy", "FSDP1Arguments"]

AutoWrapPolicy = _Policy | Callable[..., bool]
"""An FSDP1 auto-wrap policy: a policy object (``ModuleWrapPolicy``, ``CustomPolicy``) or
``callable(module, recurse, nonwrapped_numel) -> bool``."""


def _check_type(name: str, value: object, expected: type | tuple[type, ...], fix: str) -> None:
    if value is not None and not isinstance(value, expected):
        raise TypeError(f"TorchFSDPPlugin({name}=...) got {type(value).__name__}; {fix}")


@dataclasses.dataclass(frozen=True)
class FSDP1Arguments:
    """The FSDP1 arguments of :class:`TorchFSDPPlugin`, validated and mapped onto FSDP2.

    Args:
        process_group: The data-parallel group (same as the plugin's ``dp_group``).
        sharding_strategy: A ``torch.distributed.fsdp.ShardingStrategy``.
        cpu_offload: A ``torch.distributed.fsdp.CPUOffload``.
        auto_wrap_policy: An FSDP1 auto-wrap policy (``ModuleWrapPolicy``, ``CustomPolicy``,
            ``functools.partial(transformer_auto_wrap_policy, ...)``, or any
            ``callable(module, recurse, nonwrapped_numel) -> bool``).
        backward_prefetch: A ``torch.distributed.fsdp.BackwardPrefetch`` (no further effect).
        mixed_precision: A ``torch.distributed.fsdp.MixedPrecision``.
        ignored_modules: Modules whose parameters FSDP leaves alone (not sharded, and their
            gradients not reduced).
        param_init_fn: ``fn(module)`` materializing a module that has meta-device tensors
            (models built under ``LazyInitContext`` need none: the plugin materializes only
            each rank's shard of them).
        sync_module_states: Broadcast parameters and buffers from rank 0 before sharding.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument has no FSDP2 meaning here (the message names the
            replacement).
    """

    process_group: dist.ProcessGroup | None = None
    sharding_strategy: ShardingStrategy | None = None
    cpu_offload: CPUOffload | None = None
    auto_wrap_policy: AutoWrapPolicy | None = None
    backward_prefetch: BackwardPrefetch | None = None
    mixed_precision: MixedPrecision | None = None
    ignored_modules: tuple[nn.Module, ...] = ()
    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool = False

    def __post_init__(self) -> None:
        _check_type(
            "process_group",
            self.process_group,
            dist.ProcessGroup,
            "pass one ProcessGroup (for HYBRID_SHARD the plugin builds the (replicate, shard) "
            "mesh itself from LOCAL_WORLD_SIZE)",
        )
        _check_type(
            "sharding_strategy",
            self.sharding_strategy,
            ShardingStrategy,
            "use torch.distributed.fsdp.ShardingStrategy.FULL_SHARD or SHARD_GRAD_OP",
        )
        if self.sharding_strategy is ShardingStrategy.NO_SHARD:
            raise ValueError(
                "TorchFSDPPlugin(sharding_strategy=NO_SHARD) has no FSDP2 form: NO_SHARD is "
                "plain data parallelism, use TorchDDPPlugin() instead"
            )
        _check_type(
            "cpu_offload",
            self.cpu_offload,
            CPUOffload,
            "use torch.distributed.fsdp.CPUOffload(offload_params=True), or "
            "offload_policy=CPUOffloadPolicy() (FSDP2)",
        )
        if (
            self.auto_wrap_policy is not None
            and not isinstance(self.auto_wrap_policy, _Policy)
            and not callable(self.auto_wrap_policy)
        ):
            raise TypeError(
                f"TorchFSDPPlugin(auto_wrap_policy=...) got {type(self.auto_wrap_policy).__name__}"
                "; pass an FSDP1 policy (ModuleWrapPolicy, CustomPolicy, functools.partial("
                "transformer_auto_wrap_policy, transformer_layer_cls={...})) or a callable "
                "(module, recurse, nonwrapped_numel) -> bool, or use shard_module_types=[...]"
            )
        _check_type(
            "backward_prefetch",
            self.backward_prefetch,
            BackwardPrefetch,
            "use torch.distributed.fsdp.BackwardPrefetch or None",
        )
        if self.backward_prefetch not in (None, BackwardPrefetch.BACKWARD_PRE):
            logger.info(
                "TorchFSDPPlugin: backward_prefetch=%s is accepted but FSDP2 always prefetches "
                "the next module's all-gather in backward (like BACKWARD_PRE); for explicit "
                "control call FSDPModule.set_modules_to_backward_prefetch after boost",
                self.backward_prefetch,
            )
        self._check_mixed_precision()
        for module in self.ignored_modules:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"TorchFSDPPlugin(ignored_modules=...) must hold nn.Module objects, got "
                    f"{type(module).__name__}"
                )
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"TorchFSDPPlugin(param_init_fn=...) must be callable(module), got "
                f"{type(self.param_init_fn).__name__}"
            )
        if not isinstance(self.sync_module_states, bool):
            raise TypeError(
                f"TorchFSDPPlugin(sync_module_states=...) must be a bool, got "
                f"{self.sync_module_states!r}"
            )

    def _check_mixed_precision(self) -> None:
        mp = self.mixed_precision
        _check_type(
            "mixed_precision",
            mp,
            MixedPrecision,
            "use torch.distributed.fsdp.MixedPrecision(param_dtype=..., reduce_dtype=...), "
            "or mp_policy=MixedPrecisionPolicy(...) (FSDP2)",
        )
        if mp is None:
            return
        if mp.buffer_dtype is not None and not (
            isinstance(mp.buffer_dtype, torch.dtype) and mp.buffer_dtype.is_floating_point
        ):
            raise TypeError(
                f"MixedPrecision(buffer_dtype={mp.buffer_dtype!r}) must be a floating-point "
                "torch.dtype (e.g. torch.bfloat16) or None"
            )
        if mp.keep_low_precision_grads:
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) has no FSDP2 equivalent: "
                "FSDP2 gives gradients in the sharded parameters' dtype after reducing in "
                "reduce_dtype; drop keep_low_precision_grads (or use "
                "mp_policy=MixedPrecisionPolicy(reduce_dtype=...))"
            )

    # ---- mapping used by TorchFSDPPlugin.__init__ ------------------------------------------
    def dp_group(self, dp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The group to build the mesh from: ``process_group`` or ``dp_group``.

        Raises:
            ValueError: Both are given and differ, or HYBRID_SHARD is asked on a sub-group.
        """
        if self.process_group is not None and dp_group is not None:
            if self.process_group is not dp_group:
                raise ValueError(
                    "TorchFSDPPlugin got both process_group and dp_group; pass only one "
                    "(process_group is FSDP1's name for dp_group)"
                )
        group = self.process_group if self.process_group is not None else dp_group
        if self.hybrid and group is not None:
            raise ValueError(
                f"TorchFSDPPlugin(sharding_strategy={_name(self.sharding_strategy)}) builds its "
                "(replicate, shard) mesh over the whole job; pass process_group=None and "
                "dp_group=None"
            )
        return group

    @property
    def hybrid(self) -> bool:
        """Whether the strategy is HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (a 2-D mesh)."""
        return self.sharding_strategy in (
            ShardingStrategy.HYBRID_SHARD,
            ShardingStrategy._HYBRID_SHARD_ZERO2,
        )

    def reshard_after_forward(self, value: bool | None) -> bool:
        """FSDP2's ``reshard_after_forward`` from the strategy and the FSDP2 argument.

        Raises:
            ValueError: ``reshard_after_forward`` contradicts ``sharding_strategy``.
        """
        if self.sharding_strategy is None:
            return True if value is None else bool(value)
        wanted = self.sharding_strategy in (
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.HYBRID_SHARD,
        )
        if value is not None and bool(value) != wanted:
            raise ValueError(
                f"TorchFSDPPlugin(sharding_strategy={self.sharding_strategy.name}) means "
                f"reshard_after_forward={wanted}, but reshard_after_forward={value} was given; "
                "pass only one of them"
            )
        return wanted

    def mp_policy(
        self, mp_policy: MixedPrecisionPolicy | None, precision: str
    ) -> MixedPrecisionPolicy | None:
        """FSDP2's ``MixedPrecisionPolicy`` for ``mixed_precision`` (else ``mp_policy``).

        Raises:
            ValueError: ``mixed_precision`` is combined with ``mp_policy`` or a non-fp32
                ``precision``.
        """
        mp = self.mixed_precision
        if mp is None:
            return mp_policy
        if mp_policy is not None or precision != "fp32":
            raise ValueError(
                "TorchFSDPPlugin got mixed_precision (FSDP1) together with mp_policy or "
                f"precision={precision!r}; pass only one of them"
            )
        return MixedPrecisionPolicy(
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            cast_forward_inputs=bool(mp.cast_forward_inputs or mp.cast_root_forward_inputs),
        )

    def offload_policy(self, offload_policy: OffloadPolicy | None) -> OffloadPolicy | None:
        """FSDP2's offload policy for ``cpu_offload`` (else ``offload_policy``).

        Raises:
            ValueError: Both are given, or parameters are offloaded without an accelerator.
        """
        policy = offload_policy
        if self.cpu_offload is not None and self.cpu_offload.offload_params:
            if offload_policy is not None:
                raise ValueError(
                    "TorchFSDPPlugin got cpu_offload (FSDP1) together with offload_policy "
                    "(FSDP2); pass only one of them"
                )
            policy = CPUOffloadPolicy()
        if isinstance(policy, CPUOffloadPolicy):
            device = get_accelerator().get_current_device()
            if device.type == "cpu":
                raise ValueError(
                    "CPU offload (cpu_offload=CPUOffload(offload_params=True) or "
                    "offload_policy=CPUOffloadPolicy()) needs an accelerator: FSDP2's "
                    "CPUOffloadPolicy refuses to run when the model already trains on the "
                    "CPU; drop it here (parameters are in host memory anyway)"
                )
        return policy

    # ---- what TorchFSDPPlugin.configure does with them -------------------------------------
    def prepare(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        """Before sharding: ``param_init_fn``, ``sync_module_states``, then ``buffer_dtype``.

        ``param_init_fn`` runs on meta modules; the floating-point buffers are cast to
        ``mixed_precision.buffer_dtype`` last.

        Raises:
            ValueError: Tensors are still on the meta device after ``param_init_fn``.
        """
        if self.param_init_fn is not None:
            ignored = self.ignored_set()
            names = group_param_names(optimizer, model) if optimizer is not None else []
            for module in model.modules():
                if module in ignored or not _has_meta_tensors(module):
                    continue
                self.param_init_fn(module)
            if optimizer is not None:  # to_empty may have replaced the parameters
                repoint_optimizer(optimizer, model, names)
            still = [n for n, t in _named_tensors(model) if t.is_meta and not is_lazy(t)]
            if still:
                raise ValueError(
                    f"param_init_fn left tensors on the meta device: {still[:4]}; it must "
                    "materialize the module it is given (e.g. module.to_empty(device=..., "
                    "recurse=False) then module.reset_parameters())"
                )
        if self.sync_module_states:
            if has_lazy_tensors(model):  # rank 0's values must exist to be broadcast
                materialize_model(model, optimizer)
            self._broadcast(model, group, device)
        if self.mixed_precision is not None and self.mixed_precision.buffer_dtype is not None:
            self.cast_buffers(model, self.mixed_precision.buffer_dtype)

    def cast_buffers(self, model: nn.Module, dtype: torch.dtype) -> None:
        """FSDP1's ``buffer_dtype``: cast every floating-point buffer to ``dtype``.

        The ignored modules' buffers are left alone; lazy buffers stay lazy (the cast is
        recorded); a buffer shared by two modules stays shared.
        """
        ignored = self.ignored_set()
        cast: dict[int, torch.Tensor] = {}
        for module in model.modules():
            if module in ignored:
                continue
            for name, buf in list(module._buffers.items()):
                if buf is None or not buf.is_floating_point() or buf.dtype == dtype:
                    continue
                if id(buf) not in cast:
                    cast[id(buf)] = lazy_to(buf, dtype)
                module._buffers[name] = cast[id(buf)]

    @staticmethod
    def _broadcast(model: nn.Module, group: dist.ProcessGroup | None, device: torch.device) -> None:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for _, tensor in _named_tensors(model):
                data = tensor.detach()
                moved = data.to(device)
                broadcast(moved, src=src, group=group)
                if moved is not data:
                    data.copy_(moved)

    def ignored_set(self) -> set[nn.Module]:
        """The ignored modules and all their descendants."""
        return {m for module in self.ignored_modules for m in module.modules()}

    def ignored_params(self, model: nn.Module) -> set[nn.Parameter] | None:
        """FSDP2's ``ignored_params``: the parameters of the ignored modules (None if none)."""
        ignored = self.ignored_set()
        params = {p for m in ignored for p in m.parameters(recurse=False)}
        return params or None

    def wrap_units(self, model: nn.Module, default: list[nn.Module]) -> list[nn.Module]:
        """Submodules sharded as their own units, inner ones first (the root excluded).

        ``default`` (the plugin's own choice) is used without an ``auto_wrap_policy``.

        Raises:
            ValueError: A ``CustomPolicy`` returned per-module FSDP1 keyword arguments.
        """
        ignored = self.ignored_set()
        policy = self.auto_wrap_policy
        if policy is None:
            return [m for m in default if m not in ignored]
        if isinstance(policy, _Policy):
            targets = policy._run_policy(model, ignored, {})
            overrides = {type(m).__name__: kw for m, kw in targets.items() if kw}
            if overrides:
                raise ValueError(
                    f"auto_wrap_policy returned per-module FSDP1 arguments {overrides}; FSDP2 "
                    "applies one setting to every unit here: return True/False instead"
                )
            chosen: list[nn.Module] = [m for m in targets if m is not model]
        else:
            chosen = []
            _recursive_choice(model, policy, (ignored, _params_of(ignored)), chosen, True)
        # fully_shard must see inner modules before the modules that contain them.
        order = {id(m): i for i, m in enumerate(model.modules())}
        return sorted(chosen, key=lambda m: -order[id(m)])

    def hybrid_dims(self) -> ParallelDims | None:
        """The ``ParallelDims`` of HYBRID_SHARD (``dp_shard`` = one node), or None for 1-D.

        The shard group is the ranks of one node (``LOCAL_WORLD_SIZE``, set by torchrun);
        with one node the mesh is 1-D (HYBRID_SHARD is FULL_SHARD there). The plugin builds
        its ``(replicate, shard)`` mesh from the dims' ``dp_replicate`` and ``dp_shard`` groups.

        Raises:
            ValueError: The world size is not a multiple of ``LOCAL_WORLD_SIZE``.
        """
        if not self.hybrid:
            return None
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local < 1 or world % local:
            raise ValueError(
                f"sharding_strategy={_name(self.sharding_strategy)} shards within a node and "
                f"replicates across nodes, but the world size {world} is not a multiple of "
                f"LOCAL_WORLD_SIZE={local}; launch the same number of ranks on every node"
            )
        if world == local:
            return None
        return ParallelDims(dp=world, dp_shard=local)


def _name(strategy: ShardingStrategy | None) -> str:
    return "None" if strategy is None else strategy.name


def _recursive_choice(
    module: nn.Module,
    policy: Callable[..., bool],
    ignored: tuple[set[nn.Module], set[nn.Parameter]],
    chosen: list[nn.Module],
    only_children: bool = False,
) -> int:
    """FSDP1's recursive auto-wrap walk; returns the parameter count of wrapped units.

    ``policy(module, recurse=True, ...)`` decides whether to descend into a module, then
    ``policy(module, recurse=False, nonwrapped_numel=...)`` whether it becomes a unit, with
    the count of its parameters not already in a unit below it (the ignored excluded).
    """
    nonwrapped = sum(p.numel() for p in module.parameters() if p not in ignored[1])
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return 0
    wrapped = 0
    for child in module.children():
        if child not in ignored[0]:
            wrapped += _recursive_choice(child, policy, ignored, chosen)
    remainder = nonwrapped - wrapped
    if not only_children and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        chosen.append(module)
        return nonwrapped
    return wrapped


def _params_of(modules: Iterable[nn.Module]) -> set[nn.Parameter]:
    return {p for m in modules for p in m.parameters(recurse=False)}


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _has_meta_tensors(module: nn.Module) -> bool:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.is_meta and not is_lazy(t) for t in own)
