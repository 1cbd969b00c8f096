"""TorchFSDPPlugin: PyTorch FSDP2 (``fully_shard``) behind the Booster API.

Parameters become ``DTensor`` shards (dim 0) over the data-parallel mesh. Checkpoints are the
same format as every other plugin: full tensors are gathered for saving (written spread over
the ranks) and each rank reads only its rows when loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import (
    Boosted,
    Criterion,
    DPPluginBase,
    group_param_names,
    has_lazy_tensors,
    repoint_optimizer,
)
from colossal.booster.plugin.fsdp.checkpoint_io import FSDPCheckpointIO
from colossal.booster.plugin.fsdp.compat import AutoWrapPolicy, FSDP1Arguments
from colossal.checkpoint_io import CheckpointIO
from colossal.checkpoint_io.sharded import as_sharded
from colossal.checkpoint_io.template import unwrap_model
from colossal.core import ModelWrapper, OptimizerWrapper, get_accelerator, parse_precision
from colossal.core.precision import Precision
from colossal.lazy import is_lazy, materialize_tensor

logger = logging.getLogger(__name__)

__all__ = ["FSDPConfig", "TorchFSDPModel", "TorchFSDPOptimizer", "TorchFSDPPlugin"]


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """Validated settings of :class:`TorchFSDPPlugin`."""

    precision: str = "fp32"
    reshard_after_forward: bool = True
    shard_module_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        precision = parse_precision(self.precision)
        if precision is Precision.FP16:
            raise ValueError(
                "TorchFSDPPlugin does not support precision 'fp16' (FSDP2 has no loss "
                "scaler here); use precision='bf16' or 'fp32', or LowLevelZeroPlugin for fp16"
            )
        object.__setattr__(self, "precision", precision.value)


class TorchFSDPModel(ModelWrapper):
    """A model sharded in place by ``fully_shard`` (``unwrap()`` returns it)."""


class TorchFSDPOptimizer(OptimizerWrapper):
    """An optimizer over DTensor parameters.

    Its norm and clipping are :class:`colossal.core.OptimizerWrapper`'s, the one global norm
    of :mod:`colossal.core.grad_norm`: each DTensor gradient counts its shard (its mesh
    dimensions are its placements), collective over the job.
    """


def _lazy_recipes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> lazy tensor, for every parameter and buffer (tied names included)."""
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    return {n: t for n, t in named if is_lazy(t)}


def _materialize_shards(
    model: nn.Module, recipes: dict[str, torch.Tensor], device: torch.device
) -> None:
    """Allocate the sharded model and fill each rank's rows, one full tensor at a time.

    Tensors that were real already (built outside the lazy context, or assigned later) keep
    their values: ``to_empty`` reallocates every tensor, so their local data is saved first.
    """

    def named() -> list[tuple[str, torch.Tensor]]:
        return [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]

    real = {
        name: as_sharded(t).local().detach().clone()
        for name, t in named()
        if name not in recipes and not as_sharded(t).local().is_meta
    }
    model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in named():
            shard = as_sharded(tensor)
            if name in real:
                shard.local().copy_(real.pop(name))
            elif name in recipes:
                full = materialize_tensor(recipes[name])
                shard.part.real(shard.local()).copy_(shard.part.take(full))
                del full


def _module_types(model: nn.Module, names: Sequence[str] | None) -> list[nn.Module]:
    if names is None:  # default: every block of every ModuleList (transformer layers)
        return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    wanted = set(names)
    return [m for m in model.modules() if type(m).__name__ in wanted and m is not model]


class TorchFSDPPlugin(DPPluginBase):
    """Fully sharded data parallelism with PyTorch FSDP2 (``fully_shard``).

    Args:
        precision: ``"fp32"`` or ``"bf16"`` (bf16 compute, fp32 sharded params and
            gradient reduction); ``"fp16"`` is refused.
        reshard_after_forward: Free the gathered parameters after forward (ZeRO-3); False
            keeps them until backward (ZeRO-2-like).
        mp_policy: A full ``MixedPrecisionPolicy`` (overrides ``precision``).
        offload_policy: An FSDP2 ``OffloadPolicy`` (``CPUOffloadPolicy`` needs CUDA).
        shard_module_types: Class names of submodules sharded as their own units (default:
            the entries of every ``nn.ModuleList``); the root is always sharded.
        dp_group: The data-parallel group (the whole job when None).
        process_group: ColossalAI's (FSDP1) name for ``dp_group``.
        sharding_strategy: FSDP1 ``ShardingStrategy``: ``FULL_SHARD`` (default) is
            ``reshard_after_forward=True``, ``SHARD_GRAD_OP`` is ``False``, ``HYBRID_SHARD``
            shards within a node (``LOCAL_WORLD_SIZE`` ranks) and replicates across nodes
            (a 2-D mesh); ``NO_SHARD`` is refused (use ``TorchDDPPlugin``).
        cpu_offload: FSDP1 ``CPUOffload``; ``offload_params=True`` is ``CPUOffloadPolicy``
            (needs an accelerator).
        auto_wrap_policy: FSDP1 auto-wrap policy choosing the submodules sharded as their
            own units (instead of ``shard_module_types``).
        backward_prefetch: FSDP1 ``BackwardPrefetch``; accepted, FSDP2 always prefetches
            the next all-gather in backward.
        mixed_precision: FSDP1 ``MixedPrecision``; becomes ``MixedPrecisionPolicy(
            param_dtype, reduce_dtype, cast_forward_inputs)``; its ``buffer_dtype`` casts the
            floating-point buffers before sharding (``keep_low_precision_grads`` is refused).
        ignored_modules: Modules whose parameters are neither sharded nor reduced.
        param_init_fn: ``fn(module)`` called before sharding on each module holding
            meta-device tensors (it must materialize them).
        sync_module_states: Broadcast parameters and buffers from the group's rank 0 before
            sharding.
        fp8_communication: ColossalAI's float8 compression of the FSDP collectives: every
            sharded module's parameter all-gather and gradient reduce-scatter carry float8
            payloads (``fully_shard``'s ``set_custom_all_gather`` /
            ``set_custom_reduce_scatter``, see :mod:`.fp8_comm`); synchronous, so they no
            longer overlap compute.

    Raises:
        TypeError: An FSDP1 argument has the wrong type.
        ValueError: An FSDP1 argument has no FSDP2 meaning, or contradicts an FSDP2 one
            (the message names the replacement).
    """

    SUPPORTED_PRECISIONS = ("fp32", "bf16")
    CONTROLS_PRECISION = True
    SUPPORTS_NO_SYNC = True
    SUPPORTS_LORA = True

    def __init__(
        self,
        precision: str = "fp32",
        reshard_after_forward: bool | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        shard_module_types: Sequence[str] | None = None,
        dp_group: dist.ProcessGroup | None = None,
        process_group: dist.ProcessGroup | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = None,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        if not isinstance(fp8_communication, bool):
            raise TypeError(
                f"TorchFSDPPlugin: fp8_communication={fp8_communication!r} must be True or False"
            )
        self.fp8_communication = fp8_communication
        self.fsdp1 = FSDP1Arguments(
            process_group,
            sharding_strategy,
            cpu_offload,
            auto_wrap_policy,
            backward_prefetch,
            mixed_precision,
            tuple(ignored_modules or ()),
            param_init_fn,
            sync_module_states,
        )
        if auto_wrap_policy is not None and shard_module_types is not None:
            raise ValueError(
                "TorchFSDPPlugin got auto_wrap_policy (FSDP1) and shard_module_types (FSDP2); "
                "pass only one of them"
            )
        dp_group = self.fsdp1.dp_group(dp_group)
        super().__init__(dp_group)
        self.config = FSDPConfig(
            precision,
            self.fsdp1.reshard_after_forward(reshard_after_forward),
            tuple(shard_module_types) if shard_module_types is not None else None,
        )
        mp_policy = self.fsdp1.mp_policy(mp_policy, self.config.precision)
        offload_policy = self.fsdp1.offload_policy(offload_policy)
        if mp_policy is None and self.config.precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        self.offload_policy = offload_policy or OffloadPolicy()
        self._checkpoint_io = FSDPCheckpointIO(self.dp_group)

    def _mesh(self) -> DeviceMesh:
        """The DeviceMesh of ``self.parallel_dims``' groups (HYBRID_SHARD's dims first).

        1-D over ``group("dp")``, or ``(replicate, shard)`` over ``group("dp_replicate")`` and
        ``group("dp_shard")`` when the dims replicate shard groups.
        """
        hybrid = self.fsdp1.hybrid_dims()
        if hybrid is not None:
            self.parallel_dims = hybrid
        dims = self.parallel_dims
        device_type = get_accelerator().get_current_device().type
        if not dims.dp_replicate_enabled:
            return DeviceMesh.from_group(dims.group("dp"), device_type)
        layout = torch.tensor(dims.ranks("dp")).view(dims.dp_replicate, -1)  # (replicate, shard)
        return DeviceMesh.from_group(
            [dims.group("dp_replicate"), dims.group("dp_shard")],
            device_type,
            mesh=layout,
            mesh_dim_names=("replicate", "shard"),
        )

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Shard the model in place and point the optimizer at the sharded parameters."""
        device = get_accelerator().get_current_device()
        self.fsdp1.prepare(model, optimizer, self.dp_group, device)
        lazy = has_lazy_tensors(model)
        recipes = _lazy_recipes(model) if lazy else {}
        if not lazy:
            model = model.to(device)
        group_names = group_param_names(optimizer, model) if optimizer is not None else []
        mesh = self._mesh()
        ignored_params = self.fsdp1.ignored_params(model)

        def shard(module: nn.Module) -> None:
            fully_shard(
                module,
                mesh=mesh,
                reshard_after_forward=self.config.reshard_after_forward,
                mp_policy=self.mp_policy,
                offload_policy=self.offload_policy,
                ignored_params=ignored_params,
            )

        default_units = _module_types(model, self.config.shard_module_types)
        for module in self.fsdp1.wrap_units(model, default_units):
            shard(module)
        shard(model)
        if self.fp8_communication:
            from colossal.booster.plugin.fsdp.fp8_comm import use_fp8_collectives

            use_fp8_collectives(model)
        if lazy:
            _materialize_shards(model, recipes, device)
        wrapper = None
        if optimizer is not None:
            repoint_optimizer(optimizer, model, group_names)
            wrapper = TorchFSDPOptimizer(optimizer, param_names=group_names)
        return Boosted(TorchFSDPModel(model), wrapper, criterion, dataloader, lr_scheduler)

    def get_checkpoint_io(self) -> CheckpointIO:
        """Checkpoint IO that gathers DTensors to save and reads row slices to load."""
        return self._checkpoint_io

    @contextlib.contextmanager
    def _no_sync(self, module: FSDPModule) -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reduce-scatter until the context exits.

        Raises:
            TypeError: ``model`` is not the model returned by ``boost``.
        """
        sharded = unwrap_model(model) if model is not None else None
        if not isinstance(sharded, FSDPModule):
            raise TypeError(
                f"TorchFSDPPlugin.no_sync needs the model returned by boost(), got "
                f"{type(model).__name__}"
            )
        return self._no_sync(sharded)
