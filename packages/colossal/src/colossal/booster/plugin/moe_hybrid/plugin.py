"""MoeHybridParallelPlugin: expert parallelism inside data parallelism, ZeRO over moe_dp.

ColossalAI's plugin for Mixtral / DeepSeek / Qwen-MoE. The ranks are laid out by
:class:`~colossal.core.ParallelDims` with ``ep``: dp is split into ``ep`` (consecutive ranks
by default, ``moe_dp_outside=True``) x ``moe_dp = dp / ep``. Each rank holds ``E / ep`` experts
(a Hugging Face model's fused experts are replaced by
``colossal.shardformer.moe.apply_expert_parallel``; a model whose expert parameters already
carry ``"ep"`` placements is used as it is), and the optimizer is
:class:`~colossal.zero.MoeLowLevelZeroOptimizer`: dense parameters ZeRO-sharded and averaged
over dp, experts over moe_dp, one gradient norm. The rest (precision, loss scaling, clipping,
bucket sizes, checkpoint format) is :class:`HybridParallelPlugin`'s.

Not yet: tensor, pipeline or sequence parallelism together with experts
(``NotImplementedError`` naming the argument), LoRA, optimizer checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import Boosted, Criterion, materialize_model
from colossal.booster.plugin.hybrid.lora import peft_parts
from colossal.booster.plugin.hybrid.model import HybridParallelModel
from colossal.booster.plugin.hybrid.plugin import HybridParallelPlugin
from colossal.booster.plugin.moe_hybrid.checkpoint_io import MoeCheckpointIO
from colossal.booster.plugin.sharding import first_names, repoint_by_alias
from colossal.checkpoint_io import CheckpointIO
from colossal.core import OptimizerWrapper, get_accelerator, shard_spec, warn_once
from colossal.core.comm import group_ranks
from colossal.zero import MoeLowLevelZeroOptimizer, is_expert_param

logger = logging.getLogger(__name__)

__all__ = ["MoeHybridParallelPlugin"]

_ColossalAIOnly = ("overlap_p2p", "use_fp8", "fp8_communication", "force_overlap_comm")


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """Expert parallelism (``ep_size``) x data parallelism, with ZeRO-1/2 over moe_dp.

    Args:
        tp_size: Tensor-parallel size; only 1 (larger raises ``NotImplementedError``).
        pp_size: Pipeline stages; only 1 (larger raises ``NotImplementedError``).
        ep_size: Expert-parallel size: must divide ``dp = world / (tp * pp * sp)``; each rank
            holds ``E / ep_size`` experts.
        sp_size: Sequence-parallel size; only None or 1.
        precision: ``"fp16"`` (dynamic loss scaling), ``"bf16"`` or ``"fp32"``.
        zero_stage: 0, 1 or 2 for both dense and expert parameters (0 runs ZeRO-1's buckets,
            as in :class:`HybridParallelPlugin`). Stage 2 is not downgraded: experts without
            tokens cannot hang it.
        moe_dp_outside: ColossalAI's layout: ``True`` puts the ep ranks of a group next to each
            other (moe_dp outer); ``False`` the other way round.
        num_microbatches: Accepted for ColossalAI's signature (pipelines only).
        **hybrid_options: Any other :class:`HybridParallelPlugin` keyword (``max_norm``,
            ``initial_scale``, ``zero_bucket_size_in_m``, ``overlap_communication``, ...), and
            ColossalAI's ``overlap_p2p``, ``use_fp8``, ``fp8_communication``,
            ``force_overlap_comm`` (accepted; no effect).

    Raises:
        ValueError: ``ep_size`` does not divide dp (the message names the sizes).
        NotImplementedError: ``tp_size``, ``pp_size``, ``sp_size`` or sequence parallelism
            together with this plugin.
    """

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
        sp_size: int | None = None,
        precision: str = "fp16",
        zero_stage: int = 0,
        moe_dp_outside: bool = True,
        num_microbatches: int | None = None,
        **hybrid_options: object,
    ) -> None:
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("sp_size", sp_size)):
            if value not in (None, 1):
                raise NotImplementedError(
                    f"MoeHybridParallelPlugin({name}={value!r}) is not supported yet: experts "
                    f"run with ep x dp only; set {name}=1 (or use HybridParallelPlugin for a "
                    "dense model)"
                )
        if hybrid_options.get("enable_sequence_parallelism"):
            raise NotImplementedError(
                "MoeHybridParallelPlugin(enable_sequence_parallelism=True) is not supported "
                "yet; leave it False"
            )
        ignored = [k for k in _ColossalAIOnly if hybrid_options.pop(k, None)]
        if ignored:
            warn_once(logger, f"MoeHybridParallelPlugin: {', '.join(ignored)} has no effect here")
        options = cast(dict[str, Any], hybrid_options)
        super().__init__(
            1,
            1,
            sp_size,
            precision=precision,
            zero_stage=zero_stage,
            num_microbatches=num_microbatches,
            **options,
        )
        dense = self.parallel_dims
        dims = dataclasses.replace(dense, ep=ep_size, moe_dp_outside=moe_dp_outside)
        object.__setattr__(dims, "_mesh", dense._mesh)  # one mesh: no group made twice
        self.parallel_dims = dims
        # Collective: every rank asks for the same groups in the same order.
        self.ep_group = dims.group("ep")
        self.moe_dp_group = dims.group("moe_dp")
        self._checkpoint_io = MoeCheckpointIO(
            dims.coordinate("dp") == 0, dims.coordinate("moe_dp") == 0
        )

    @property
    def ep_size(self) -> int:
        """Expert-parallel size."""
        return self.parallel_dims.ep

    @property
    def moe_dp_size(self) -> int:
        """Ranks holding the same experts (their data-parallel size)."""
        return self.parallel_dims.moe_dp

    def support_lora(self) -> bool:
        """False: adapters on expert-parallel models are not supported yet."""
        return False

    def support_no_sync(self) -> bool:
        """ZeRO stage 0 and 1."""
        return self.config.zero_stage < 2

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Shard the experts over ep, wrap the optimizer in ``MoeLowLevelZeroOptimizer``.

        Raises:
            NotImplementedError: A LoRA model, or a model without expert-parallel
                parameters that ``apply_expert_parallel`` cannot shard (``ep_size > 1``).
            ValueError: Expert parameters placed along an ep group other than the plugin's.
        """
        materialize_model(model, optimizer)
        if peft_parts(model)[1] is not None:
            raise NotImplementedError("MoeHybridParallelPlugin does not support LoRA yet")
        dtype = self.precision_dtype
        model = model.to(device=get_accelerator().get_current_device(), dtype=dtype)
        group_names = _group_names(optimizer, model)
        if not any(is_expert_param(p) for p in model.parameters()) and self.ep_size > 1:
            _apply_expert_parallel(model, self.ep_group)
        self._check_expert_group(model)
        if optimizer is not None:
            before = [len(g["params"]) for g in optimizer.param_groups]
            repoint_by_alias(optimizer, model, group_names)
            after = [len(g["params"]) for g in optimizer.param_groups]
            if after != before:
                raise RuntimeError(
                    f"the optimizer's groups held {before} parameters but {after} after the "
                    "experts were replaced: the expert-parallel modules must keep the "
                    "parameter names"
                )
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._checkpoint_io.set_aliases(list(aliases.values()))
        zero = None
        if optimizer is not None:
            names = first_names(optimizer, model)
            zero = MoeLowLevelZeroOptimizer(
                optimizer,
                moe_dp_process_group=self.moe_dp_group,
                dp_process_group=self.dp_group,
                ep_size=self.ep_size,
                scaler_config=self.scaler_config,
                verbose=self.verbose,
                **dataclasses.asdict(self.zero_config),
            )
            zero.set_param_names(names)
            self._checkpoint_io.optimizers.extend(zero.parts)
        wrapped = HybridParallelModel(model, dtype, pipelined=False)
        return Boosted(wrapped, zero, criterion, dataloader, lr_scheduler)

    def _check_expert_group(self, model: nn.Module) -> None:
        want = group_ranks(self.ep_group)
        for name, p in model.named_parameters():
            spec = shard_spec(p)
            placement = None if spec is None else spec.axis("ep")
            if spec is None or placement is None or tuple(spec.shape) == tuple(p.shape):
                continue  # not an expert, or all experts held here (ep 1)
            if group_ranks(placement.group) != want:
                raise ValueError(
                    f"{name} is placed along the ep ranks {group_ranks(placement.group)}, but "
                    f"this plugin's ep group is {want}; build the experts with "
                    "plugin.ep_group (or pass the plain model and let the plugin shard it)"
                )

    def get_checkpoint_io(self) -> CheckpointIO:
        """Model checkpoints in the one format, experts gathered from their ep ranks."""
        return self._checkpoint_io

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reducing them (ZeRO stage 0/1).

        Raises:
            NotImplementedError: Under ZeRO stage 2.
            TypeError: No boosted optimizer given.
        """
        if self.config.zero_stage == 2:
            raise NotImplementedError(
                "MoeHybridParallelPlugin(zero_stage=2) does not support no_sync(); use "
                "zero_stage=1 or call booster.backward for every micro-batch"
            )
        if not isinstance(optimizer, MoeLowLevelZeroOptimizer):
            raise TypeError("no_sync needs the optimizer returned by boost()")
        return optimizer.no_sync()


def _group_names(optimizer: Optimizer | None, model: nn.Module) -> list[list[list[str]]]:
    """Per param group, every name of each parameter (to repoint after the experts change)."""
    if optimizer is None:
        return []
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    return [[by_param[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup) -> list[str]:
    """Replace a Hugging Face MoE model's experts by expert-parallel ones (colossal-shardformer)."""
    module = importlib.import_module("colossal.shardformer.moe")
    apply = getattr(module, "apply_expert_parallel", None)
    if apply is None:
        raise NotImplementedError(
            f"{type(model).__name__} has no expert-parallel parameters and this "
            "colossal-shardformer has no apply_expert_parallel to shard it; build the model "
            "with colossal.shardformer.moe layers over plugin.ep_group, or use ep_size=1"
        )
    replaced = cast(Callable[[nn.Module, dist.ProcessGroup], list[str]], apply)(model, ep_group)
    if not replaced:
        raise NotImplementedError(
            f"apply_expert_parallel found no experts to shard in {type(model).__name__}; "
            "use ep_size=1 or a supported MoE family"
        )
    return replaced
