"""MoeHybridParallelPlugin: expert parallelism inside data parallelism, with TP, PP and LoRA.

ColossalAI's plugin for Mixtral / DeepSeek / Qwen-MoE. The ranks are laid out by
:class:`~colossal.core.ParallelDims` with ``ep``: dp (``world / (tp * pp)``) is split into
``ep`` (consecutive ranks by default, ``moe_dp_outside=True``) x ``moe_dp = dp / ep``. Each
rank holds ``E / ep`` experts (a Hugging Face model's fused experts are replaced by
``colossal.shardformer.moe.apply_expert_parallel``; a model whose expert parameters already
carry ``"ep"`` placements is used as it is), and the optimizer is
:class:`~colossal.zero.MoeLowLevelZeroOptimizer`: dense parameters ZeRO-sharded and averaged
over dp, experts over moe_dp, one gradient norm.

With ``tp_size > 1`` or ``pp_size > 1`` the dense layers go through
:class:`HybridParallelPlugin`'s Shardformer path (the model's ``base_model_tp_plan`` or
``custom_policy``; the 1F1B schedule, ``execute_pipeline``): the experts are left out of the
tensor-parallel plan (every tp rank holds the same experts, recorded as replicated over tp, so
the norm and checkpoints count them once) and each stage's experts are expert-parallel over
the ep ranks of that stage. ``Booster.enable_lora`` puts peft adapters on the dense layers;
the base weights, experts included, stay frozen. The rest (precision, loss scaling, clipping,
bucket sizes, checkpoint format) is :class:`HybridParallelPlugin`'s.

Not supported (``NotImplementedError`` naming the argument): sequence parallelism, the grid
tensor-parallel modes, interleaved and ZB-V pipelines. Model and optimizer checkpoints work in
every layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import Boosted, Criterion, materialize_model
from colossal.booster.plugin.fp8 import use_fp8_linears
from colossal.booster.plugin.hybrid.lora import peft_parts
from colossal.booster.plugin.hybrid.model import HybridParallelModel
from colossal.booster.plugin.hybrid.plugin import HybridParallelPlugin
from colossal.booster.plugin.moe_hybrid.checkpoint_io import MoeCheckpointIO
from colossal.booster.plugin.moe_hybrid.layout import drop_expert_tp_plan, mark_experts_replicated
from colossal.booster.plugin.sharding import first_names, repoint_by_alias
from colossal.checkpoint_io import CheckpointIO
from colossal.core import OptimizerWrapper, get_accelerator, shard_spec, warn_once
from colossal.core.comm import group_ranks
from colossal.zero import MoeLowLevelZeroOptimizer, is_expert_param

logger = logging.getLogger(__name__)

__all__ = ["MoeHybridParallelPlugin"]

_ColossalAIOnly = ("overlap_p2p", "force_overlap_comm")


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """Expert parallelism (``ep_size``) x data parallelism (ZeRO-1/2 over moe_dp) x TP x PP.

    Args:
        tp_size: Tensor-parallel size of the dense layers (experts are replicated over tp).
        pp_size: Pipeline stages (1F1B; needs ``num_microbatches`` or ``microbatch_size``).
        ep_size: Expert-parallel size: must divide ``dp = world / (tp * pp)``; each rank
            holds ``E / ep_size`` experts.
        sp_size: Sequence-parallel size; only None or 1.
        precision: ``"fp16"`` (dynamic loss scaling), ``"bf16"`` or ``"fp32"``.
        zero_stage: 0, 1 or 2 for both dense and expert parameters (0 runs ZeRO-1's buckets,
            as in :class:`HybridParallelPlugin`). Stage 2 is not downgraded: experts without
            tokens cannot hang it.
        moe_dp_outside: ColossalAI's layout: ``True`` puts the ep ranks of a group next to each
            other (moe_dp outer); ``False`` the other way round.
        num_microbatches: Microbatches per batch under a pipeline.
        **hybrid_options: Any other :class:`HybridParallelPlugin` keyword (``max_norm``,
            ``initial_scale``, ``zero_bucket_size_in_m``, ``overlap_communication``, ...), and
            ColossalAI's ``overlap_p2p``, ``force_overlap_comm`` (accepted; no effect).
            ``fp8_communication=True`` reduces the dense and expert gradients and gathers
            their ZeRO slices as float8; the experts' token all-to-all (uneven splits, under
            autograd) is not compressed. ``use_fp8=True`` runs the dense linear layers in
            float8 as :class:`HybridParallelPlugin` does (refused where the device lacks
            ``torch._scaled_mm``); the experts' grouped matmuls stay unquantized.

    Raises:
        ValueError: ``ep_size`` does not divide dp, or what :class:`HybridParallelPlugin`
            refuses (sizes not dividing the world, ZeRO-2 with a pipeline); the message names
            the sizes.
        NotImplementedError: ``sp_size > 1``, ``enable_sequence_parallelism``, a grid
            ``tensor_parallel_mode``, ``pp_style`` other than ``"1f1b"`` or several model
            chunks.
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
        _refuse_unsupported(sp_size, hybrid_options)
        ignored = [k for k in _ColossalAIOnly if hybrid_options.pop(k, None)]
        if ignored:
            warn_once(logger, f"MoeHybridParallelPlugin: {', '.join(ignored)} has no effect here")
        options = cast(dict[str, Any], hybrid_options)
        super().__init__(
            tp_size,
            pp_size,
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
        writers = (dims.coordinate("dp") == 0, dims.coordinate("moe_dp") == 0)
        pp_group = self.pp_group if pp_size > 1 else None
        self._checkpoint_io = MoeCheckpointIO(*writers, (tp_size, pp_size), pp_group)

    @property
    def ep_size(self) -> int:
        """Expert-parallel size."""
        return self.parallel_dims.ep

    @property
    def moe_dp_size(self) -> int:
        """Ranks holding the same experts (their data-parallel size)."""
        return self.parallel_dims.moe_dp

    def support_lora(self) -> bool:
        """True: peft adapters on the dense layers; the base weights (experts too) are frozen.

        Hugging Face's fused experts are 3-D parameters, not ``nn.Linear`` layers, so peft's
        ``target_modules`` do not reach them: they stay frozen and expert-parallel.
        """
        return True

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
        """Shard the experts over ep, the rest as :class:`HybridParallelPlugin` does.

        The experts are replaced first (``apply_expert_parallel``, on the model inside a
        ``PeftModel``); under tensor or pipeline parallelism (or LoRA) Shardformer then splits
        the dense layers and cuts this rank's stage, with the experts left out of the
        tensor-parallel plan and recorded as replicated over tp. The optimizer is wrapped in
        ``MoeLowLevelZeroOptimizer`` (told the tp and pp groups: one gradient norm).

        Raises:
            NotImplementedError: A model without expert-parallel parameters that
                ``apply_expert_parallel`` cannot shard (``ep_size > 1``).
            ValueError: Expert parameters placed along an ep group other than the plugin's,
                or head counts the tensor-parallel size does not divide.
        """
        materialize_model(model, optimizer)
        inner, peft_model, prefix = peft_parts(model)
        dtype = self.precision_dtype
        model = model.to(device=get_accelerator().get_current_device(), dtype=dtype)
        group_names = _group_names(optimizer, model)
        if not any(is_expert_param(p) for p in model.parameters()) and self.ep_size > 1:
            _apply_expert_parallel(inner, self.ep_group)
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
        if self.tp_size == 1 and self.pp_size == 1 and peft_model is None:
            module: nn.Module = model
            aliases: dict[int, list[str]] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                aliases.setdefault(id(p), []).append(name)
            self._checkpoint_io.set_aliases(list(aliases.values()))
        else:
            module = self._shard(inner, optimizer, peft_model is not None, prefix)
        if self.use_fp8:
            use_fp8_linears(module)
        zero = None
        if optimizer is not None:
            names = first_names(optimizer, module)
            zero = MoeLowLevelZeroOptimizer(
                optimizer,
                moe_dp_process_group=self.moe_dp_group,
                dp_process_group=self.dp_group,
                is_expert=_trainable_expert,
                ep_size=self.ep_size,
                scaler_config=self.scaler_config,
                verbose=self.verbose,
                tp_process_group=self.tp_group if self.tp_size > 1 else None,
                pp_process_group=self.pp_group if self.pp_size > 1 else None,
                overlap_allgather=self.overlap_allgather,
                **dataclasses.asdict(self.zero_config),
            )
            zero.set_param_names(names)
            self._checkpoint_io.optimizers.extend(zero.parts)
        wrapped = HybridParallelModel(module, dtype, pipelined=self.stage_manager is not None)
        if peft_model is not None:
            wrapped.lora_source = self._lora_source(peft_model, module, prefix)
        return Boosted(wrapped, zero, criterion, dataloader, lr_scheduler)

    def _shard(
        self, inner: nn.Module, optimizer: Optimizer | None, lora: bool, prefix: str
    ) -> nn.Module:
        """Shardformer's tensor-parallel split and pipeline stage of the expert-parallel model.

        Returns:
            This rank's module (its stage under a pipeline).
        """
        from colossal.shardformer import ShardConfig

        shard_config = ShardConfig(
            tensor_parallel_process_group=self.tp_group,
            pipeline_stage_manager=self.stage_manager,
            enable_tensor_parallelism=self.tp_size > 1,
            **self.shard_options.shard_config_kwargs(),
        )
        policy = self.custom_policy
        if policy is None and self.tp_size > 1:
            drop_expert_tp_plan(inner)
        if lora:
            policy = self._lora_policy(inner, policy)
        module = self._shard_stage(inner, optimizer, shard_config, policy, prefix)
        if self.tp_size > 1:
            mark_experts_replicated(module, self.tp_group)
        return module

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


def _trainable_expert(param: torch.Tensor) -> bool:
    """An expert parameter that trains (frozen ones, LoRA's base experts, need no ZeRO part)."""
    return param.requires_grad and is_expert_param(param)


def _refuse_unsupported(sp_size: int | None, options: dict[str, object]) -> None:
    """``NotImplementedError`` naming an option this plugin does not run with experts."""
    if sp_size not in (None, 1):
        raise NotImplementedError(
            f"MoeHybridParallelPlugin(sp_size={sp_size!r}) is not supported: the experts do "
            "not follow a sequence split; set sp_size=1"
        )
    refused = {
        "enable_sequence_parallelism": (False, "leave it False"),
        "tensor_parallel_mode": ("1d", "the grid modes have no expert layers; use '1d'"),
        "pp_style": ("1f1b", "only the 1F1B schedule runs with experts; use '1f1b'"),
        "num_model_chunks": (1, "one model chunk per stage (1F1B); use 1"),
    }
    for name, (default, fix) in refused.items():
        value = options.get(name, default)
        if value != default:
            raise NotImplementedError(
                f"MoeHybridParallelPlugin({name}={value!r}) is not supported: {fix}"
            )


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
