"""LowLevelZeroOptimizer: ZeRO stage 1 and 2 around any elementwise torch optimizer."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core import DynamicGradScaler, OptimizerWrapper, keep_alive
from colossal.core.comm import broadcast, group_ranks
from colossal.core.grad_norm import NormTerm, norm_share, reduce_norm
from colossal.core.precision import Precision, ScalerConfig, scaler_config_from
from colossal.zero.config import ZeroConfig
from colossal.zero.extra_dp import combine_dp_groups
from colossal.zero.fused_step import fused_when_unset
from colossal.zero.layout import Bucket, GroupLayout, plan_layout
from colossal.zero.memory import MemoryReport
from colossal.zero.param_gather import ParamGatherer
from colossal.zero.param_maps import MasterMaps, find_slot, full_param_grad, padding_after
from colossal.zero.placements import ImpliedAxes, norm_group, slice_norm_terms
from colossal.zero.reducer import GradReducer
from colossal.zero.state_dict import gather_state_dict, scatter_state_dict

logger = logging.getLogger(__name__)


class LowLevelZeroOptimizer(OptimizerWrapper):
    """Shards optimizer states (stage 1) and gradients (stage 2) over a data-parallel group.

    Replace ``DDP(model)`` + ``optimizer`` in a training script with the bare model and
    ``LowLevelZeroOptimizer(optimizer)``, then call ``optimizer.backward(loss)`` instead of
    ``loss.backward()``. Each rank keeps full working parameters (views into one flat buffer
    per param group), an fp32 master copy and the optimizer states of its own slice only.
    The precision follows the parameters' dtype: fp32, bf16, or fp16 with dynamic loss scaling.

    Gradients are averaged over the group as with DDP. The wrapped optimizer must be
    elementwise (SGD, Adam, AdamW, ...): it sees flat slices, not the original shapes.

    Under a pipeline schedule (``colossal.pipeline``), give each stage its own stage-1
    optimizer over that stage's parameters, with ``dp_process_group`` the data-parallel axis
    and ``pp_process_group`` the pipeline axis, and pass it to ``forward_backward_step``: the
    schedule accumulates every microbatch's gradients locally (through :meth:`no_sync`) and
    reduces them once, in its last weight-gradient backward. The gradient norm (and the fp16
    overflow verdict) is the one of :mod:`colossal.core.grad_norm` over each parameter's
    placements (its own, then its slice here), reduced over the whole job as soon as a
    parameter lies along another axis, so every stage keeps the same loss scale. Stage 2
    cannot accumulate locally and is refused by the schedule.

    Args:
        optimizer: The optimizer over the model's parameters (its state must be empty).
        partition_grad: Stage 2 (gradients sharded too) when True; stage 1 otherwise.
        dp_process_group: The data-parallel group (the whole job when None).
        initial_scale: fp16 loss scaler: initial scale.
        min_scale: fp16 loss scaler: smallest scale.
        growth_factor: fp16 loss scaler: growth multiplier.
        backoff_factor: fp16 loss scaler: backoff multiplier.
        growth_interval: fp16 loss scaler: clean steps between growths.
        hysteresis: fp16 loss scaler: overflows tolerated before a backoff.
        max_scale: fp16 loss scaler: largest scale.
        clip_grad_norm: Clip gradients to this global norm at every step (0 disables).
        norm_type: Norm used for clipping and :meth:`get_grad_norm`.
        reduce_bucket_size: Elements per gradient bucket.
        communication_dtype: dtype gradients are reduced in (the parameters' by default).
        overlap_communication: Reduce full buckets asynchronously during backward.
        cpu_offload: Keep master weights, their gradients and optimizer states on the CPU.
        master_weights: Keep fp32 master weights for fp16/bf16 parameters.
        tp_process_group: The tensor-parallel axis a parameter without a placement record
            (:func:`colossal.core.mark_sharded`) is replicated over (counted once in the norm).
        pp_process_group: The pipeline axis: a parameter whose record names no ``"pp"`` axis
            belongs to this rank's stage. Parameters that carry their placements need neither.
        overlap_allgather: Return from ``step`` before the parameter all-gather ends; the
            next forward (or any other read of a parameter) waits for each parameter's bucket
            just in time (see :mod:`colossal.zero.param_gather`). On by default.
        verbose: Log overflows and scale changes at INFO level.
        scaler_config: The fp16 loss scaler's settings as one ``ScalerConfig`` (instead of
            the seven keyword settings above).
        fp8_communication: Move gradients (reduce-scatter, stage 1 too) and the updated
            parameters (all-gather) as float8 e4m3 with per-piece scales
            (:mod:`colossal.core.comm.fp8`): a quarter of the bytes, synchronous (no overlap),
            each value within 6.25% (plus the codec's subnormal term) of its exact value.
            The masters stay exact; each rank's own parameter slice too.
        grad_divisor: What the gradients summed over the group are divided by (the group
            size by default: the mean, as DDP). Expert parameters whose gradients already sum
            over ``ep`` ranks' tokens use ``moe_dp * ep`` (see :mod:`colossal.zero.moe`).

        extra_dp_group: ColossalAI's second (inter-node) data-parallel group: parameters,
            gradients and states are sharded over ``dp_process_group`` x ``extra_dp_group``
            (:func:`colossal.zero.extra_dp.combine_dp_groups` builds that group; collective
            over the whole job, every rank constructs its optimizer).

    ColossalAI's per-parameter helpers: :attr:`working_to_master_param`,
    :attr:`master_to_working_param`, :meth:`get_param_padding_size`, :meth:`get_param_grad`
    (see :mod:`colossal.zero.param_maps` for how they map to the bucket layout) and
    ``_force_wait_all_gather`` (:meth:`wait_params`).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: mixed parameter dtypes or devices, an unsupported dtype, an optimizer
            with state, or invalid settings.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        partition_grad: bool = False,
        dp_process_group: dist.ProcessGroup | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        clip_grad_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size: int = 12 * 1024**2,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        cpu_offload: bool = False,
        master_weights: bool = True,
        tp_process_group: dist.ProcessGroup | None = None,
        pp_process_group: dist.ProcessGroup | None = None,
        overlap_allgather: bool = True,
        verbose: bool = False,
        scaler_config: ScalerConfig | None = None,
        grad_divisor: int | None = None,
        fp8_communication: bool = False,
        extra_dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optimizer)
        scaler = scaler_config_from(
            {
                "initial_scale": initial_scale,
                "min_scale": min_scale,
                "growth_factor": growth_factor,
                "backoff_factor": backoff_factor,
                "growth_interval": growth_interval,
                "hysteresis": hysteresis,
                "max_scale": max_scale,
            },
            scaler_config,
            owner="LowLevelZeroOptimizer",
        )
        if not dist.is_initialized():
            raise RuntimeError(
                "LowLevelZeroOptimizer needs torch.distributed initialized (torchrun + "
                "colossal.core.launch_from_torch() or torch.distributed.init_process_group)"
            )
        self.config = ZeroConfig(
            partition_grad=bool(partition_grad),
            clip_grad_norm=float(clip_grad_norm),
            norm_type=float(norm_type),
            reduce_bucket_size=reduce_bucket_size,
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            cpu_offload=cpu_offload,
            master_weights=master_weights,
            fp8_communication=bool(fp8_communication),
        )
        if extra_dp_group is not None:  # ZeRO over dp x extra_dp: one group of all its ranks
            dp_process_group = combine_dp_groups(dp_process_group, extra_dp_group)
        # Held to the end of the process: freeing one later cannot deadlock (group_lifetime).
        for held in (dp_process_group or dist.group.WORLD, tp_process_group, pp_process_group):
            keep_alive(held)
        self.dp_group = dp_process_group
        self._dp_ranks = group_ranks(dp_process_group)
        self.world_size = len(self._dp_ranks)
        self.rank = self._dp_ranks.index(dist.get_rank())
        if grad_divisor is not None and (
            isinstance(grad_divisor, bool) or not isinstance(grad_divisor, int) or grad_divisor < 1
        ):
            raise ValueError(
                f"grad_divisor={grad_divisor!r} must be a positive int (or None: the group size)"
            )
        self.grad_divisor = self.world_size if grad_divisor is None else grad_divisor
        # Parameters without a placement record lie along these axes (ColossalAI's arguments).
        self._implied = ImpliedAxes(tp_process_group, pp_process_group)
        self._verbose = verbose

        members, self._all_params = self._collect_params(optimizer)
        self._group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        trainable = [p for g in members for _, p in g]
        self.precision, self.device = self._check_params(trainable)
        self.scaler_config = scaler
        self.scaler = DynamicGradScaler(scaler) if self.precision is Precision.FP16 else None
        self.layouts, self.buckets = plan_layout(
            members, self.world_size, self.config.reduce_bucket_size
        )
        self.flat_params = self._build_flat_params(self.layouts)
        self.masters, self._master_is_view = self._build_masters()
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = [self.masters[b.order] for b in self.layouts[g].buckets]
        comm_dtype = self.config.communication_dtype or self.precision.dtype
        self.reducer = GradReducer(
            self.layouts,
            self.buckets,
            self.config.partition_grad,
            dp_process_group,
            self.world_size,
            self.rank,
            comm_dtype,
            self._master_dtype,
            self._master_device,
            self.device,
            self.config.overlap_communication,
            self.config.fp8_communication,
        )
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(
                functools.partial(_grad_hook, self.reducer, bucket, slot)
            )
            for bucket in self.buckets
            for slot in bucket.slots
        ]
        self._managed_ids: set[int] | None = None
        self.gatherer = ParamGatherer(
            self.buckets,
            self.flat_params,
            self.rank,
            self.world_size,
            dp_process_group,
            overlap_allgather,
            self.config.fp8_communication,
        )
        self._grad_norm: float | None = None
        self._pending_clip: float | None = None
        self._terms: list[list[tuple[int, int, NormTerm]]] | None = None
        self._norm_reduce_group: dist.ProcessGroup | None = dp_process_group

    # ---- construction ----------------------------------------------------------------------
    @staticmethod
    def _collect_params(
        optimizer: Optimizer,
    ) -> tuple[list[list[tuple[int, torch.Tensor]]], list[torch.Tensor]]:
        if optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it in LowLevelZeroOptimizer before its "
                "first step and restore checkpoints through LowLevelZeroOptimizer.load_state_dict"
            )
        members: list[list[tuple[int, torch.Tensor]]] = []
        all_params: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            trainable = []
            for p in group["params"]:  # torch already refuses a parameter in two groups
                if p.requires_grad:
                    trainable.append((len(all_params), p))
                all_params.append(p)
            members.append(trainable)
        return members, all_params

    @staticmethod
    def _check_params(params: Sequence[torch.Tensor]) -> tuple[Precision, torch.device]:
        if not params:
            raise ValueError(
                "the optimizer has no trainable parameters (all have requires_grad=False)"
            )
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"trainable parameters have mixed dtypes {sorted(map(str, dtypes))}; "
                "cast the model "
                "to one of float32, float16, bfloat16 first (e.g. model.to(torch.bfloat16))"
            )
        if len(devices) > 1:
            raise ValueError(
                f"trainable parameters are on several devices {sorted(map(str, devices))}"
            )
        return Precision.from_dtype(dtypes.pop()), devices.pop()

    def _build_flat_params(self, layouts: Sequence[GroupLayout]) -> list[torch.Tensor]:
        flats = []
        src = self._dp_ranks[0]
        for layout in layouts:
            flat = torch.zeros(layout.numel, dtype=self.precision.dtype, device=self.device)
            with torch.no_grad():
                for slot in layout.slots:
                    flat[slot.offset : slot.end].copy_(slot.param.detach().reshape(-1))
                # Start from identical weights on every rank, as DDP does.
                if self.world_size > 1 and layout.numel:
                    broadcast(flat, src=src, group=self.dp_group)
                for slot in layout.slots:
                    slot.param.data = flat[slot.offset : slot.end].view_as(slot.param)
            flats.append(flat)
        return flats

    @property
    def _master_device(self) -> torch.device:
        return torch.device("cpu") if self.config.cpu_offload else self.device

    @property
    def _master_dtype(self) -> torch.dtype:
        if self.precision is Precision.FP32 or not self.config.master_weights:
            return self.precision.dtype
        return torch.float32

    def _build_masters(self) -> tuple[list[torch.Tensor], bool]:
        as_view = self._master_dtype == self.precision.dtype and self._master_device == self.device
        masters = []
        for bucket in self.buckets:
            lo, hi = bucket.shard_range(self.rank, self.world_size)
            shard = self.flat_params[bucket.group][lo:hi].detach()
            if not as_view:
                shard = shard.to(device=self._master_device, dtype=self._master_dtype, copy=True)
            masters.append(shard)
        return masters, as_view

    # ---- backward --------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        retain_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Back-propagate ``loss`` (scaled under fp16) and reduce the gradients.

        Args:
            loss: A scalar loss, or several (their gradients add up).
            retain_graph: Keep the graph for another backward through it.
            inputs: Accumulate gradients into these tensors only, as in
                :func:`torch.autograd.backward` (a pipeline's split backward: inputs first,
                parameters later). Gradients reach the buckets when parameters receive them.
        """
        losses = _tensors(loss, "loss")
        if self.scaler is not None:
            losses = [self.scaler.scale_loss(t.float()) for t in losses]
        self._run_backward(losses, None, retain_graph, inputs)

    def backward_by_grad(
        self,
        tensor: torch.Tensor | Sequence[torch.Tensor],
        grad: torch.Tensor | Sequence[torch.Tensor],
        retain_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Back-propagate from ``tensor`` with gradient ``grad`` (e.g. a pipeline stage).

        Under fp16, ``grad`` must already carry the loss scale: it is the gradient of the
        *scaled* loss, as a pipeline stage receives it from the next stage (whose
        :meth:`backward` scaled the loss). It is not scaled again; outside a pipeline, pass
        the gradient of ``loss * optimizer.loss_scale``. Without fp16 the scale is 1.

        Args:
            tensor: A tensor, or a sequence of tensors, to back-propagate from.
            grad: The gradient of each tensor (same structure as ``tensor``).
            retain_graph: Keep the graph for another backward through it.
            inputs: Accumulate gradients into these tensors only (see :meth:`backward`).

        Raises:
            ValueError: ``tensor`` and ``grad`` differ in length.
            TypeError: they are not tensors or sequences of tensors.
        """
        tensors = _tensors(tensor, "tensor")
        grads = _tensors(grad, "grad")
        if len(tensors) != len(grads):
            raise ValueError(
                f"backward_by_grad got {len(tensors)} tensors but {len(grads)} gradients; "
                "pass one gradient per tensor"
            )
        self._run_backward(tensors, grads, retain_graph, inputs)

    def _run_backward(
        self,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        retain_graph: bool,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> None:
        self.reducer.prepare_backward()
        torch.autograd.backward(
            tensors,
            grads,
            retain_graph=retain_graph,
            inputs=None if inputs is None else _tensors(inputs, "inputs"),
        )
        self._after_backward()

    def _after_backward(self) -> None:
        self.reducer.flush()
        self._grad_norm = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without communication (stage 1 only).

        Raises:
            RuntimeError: under stage 2, whose gradient slices only exist after a reduction;
                there, accumulate with plain ``backward`` calls (each one reduces).
        """
        if self.config.partition_grad:
            raise RuntimeError(
                "no_sync() needs full local gradients, which stage 2 (partition_grad=True) does "
                "not keep; use stage 1 (partition_grad=False) for communication-free "
                "accumulation and under pipeline parallelism (whose schedules accumulate every "
                "microbatch locally and reduce once per step), or call backward() for every "
                "micro-batch under stage 2 (each call reduces its gradients)"
            )
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    @property
    def accumulating(self) -> bool:
        """Whether backwards now accumulate locally (inside :meth:`no_sync`)."""
        return not self.reducer.sync

    # ---- norm and clipping -------------------------------------------------------------------
    def _norm_terms(self) -> list[list[tuple[int, int, NormTerm]]]:
        """How each parameter's piece of this rank's gradient slices counts (computed once)."""
        if self._terms is None:
            params = [slot.param for bucket in self.buckets for slot in bucket.slots]
            self._norm_reduce_group = norm_group(params, self.dp_group, self._implied)
            self._terms = slice_norm_terms(
                self.buckets,
                self.rank,
                self.world_size,
                self.dp_group,
                self._norm_reduce_group,
                self._implied,
            )
        return self._terms

    def _norm_pieces(self) -> Iterator[tuple[torch.Tensor, NormTerm]]:
        for bucket, pieces in zip(self.buckets, self._norm_terms(), strict=True):
            if not pieces:
                continue
            shard = self.reducer.shard_grad(bucket)
            for at, length, term in pieces:
                yield shard[at : at + length], term

    def _compute_norm(self) -> float:
        self.reducer.ensure_reduced()
        if self._grad_norm is None:
            p = self.config.norm_type
            share = norm_share(self._norm_pieces(), p, device=torch.device("cpu"))
            raw = float(reduce_norm(share, p, self._norm_reduce_group).item())
            self._grad_norm = raw / (self.grad_divisor * self.loss_scale)
        return self._grad_norm

    def clip_grad_by_norm(self, max_norm: float, norm_type: float | None = None) -> float:
        """Clip the gradients of the coming step to ``max_norm``; return their global norm.

        The clip is applied inside :meth:`step`, in the same pass that unscales gradients.
        Collective: every rank of the group must call it.
        """
        if norm_type is not None and norm_type != self.config.norm_type:
            raise ValueError(
                f"norm_type={norm_type} differs from the optimizer's "
                f"norm_type={self.config.norm_type}; "
                "set norm_type when creating LowLevelZeroOptimizer"
            )
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._pending_clip = float(max_norm)
        return self._compute_norm()

    def get_grad_norm(self, norm_type: float | None = None) -> float | None:
        """Global norm of the (unscaled, averaged) gradients of the last step, if any."""
        return self._grad_norm

    # ---- step --------------------------------------------------------------------------------
    def step(self, closure: None = None) -> None:
        """Unscale and clip the gradient slices in one pass, step, then all-gather parameters.

        Under fp16 a step whose gradients overflowed on any rank is skipped on every rank
        and the loss scale backs off.
        """
        if closure is not None:
            raise ValueError("LowLevelZeroOptimizer.step does not take a closure")
        self.gatherer.wait_all()
        norm = self._compute_norm()
        overflow = not math.isfinite(norm)
        # The gradients carry the scale the loss was multiplied by: read it before the
        # scaler grows it (growth_interval reached) or backs it off.
        scaled_by = self.loss_scale
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            if self.scaler is None:
                raise FloatingPointError(
                    f"gradient norm is {norm} without fp16 loss scaling; check the loss"
                )
            (logger.info if self._verbose else logger.debug)(
                "gradient overflow: step skipped, loss scale now %g", self.scaler.scale
            )
            self._finish_step()
            return
        factor = 1.0 / (self.grad_divisor * scaled_by)
        max_norm = self._pending_clip or self.config.clip_grad_norm
        if max_norm > 0 and norm > max_norm:
            factor *= max_norm / (norm + 1e-6)
        for bucket, master in zip(self.buckets, self.masters, strict=True):
            master.grad = self._master_grad(bucket, master, factor)
        with fused_when_unset(self.optim):
            self.optim.step()
        self._gather_params()
        self._finish_step()

    def _master_grad(self, bucket: Bucket, master: torch.Tensor, factor: float) -> torch.Tensor:
        shard = self.reducer.shard_grad(bucket)
        if shard.dtype == master.dtype and shard.device == master.device:
            return shard.mul_(factor)
        return shard.to(device=master.device, dtype=master.dtype).mul_(factor)

    def _gather_params(self) -> None:
        if not self._master_is_view:
            with torch.no_grad():
                for bucket, master in zip(self.buckets, self.masters, strict=True):
                    lo, hi = bucket.shard_range(self.rank, self.world_size)
                    self.flat_params[bucket.group][lo:hi].copy_(master)
        self.gatherer.gather()

    def wait_params(self) -> None:
        """Block until the parameters are complete (only needed with ``overlap_allgather``)."""
        self.gatherer.wait_all()

    _force_wait_all_gather = wait_params  # ColossalAI's name

    # ---- ColossalAI's per-parameter view (colossal.zero.param_maps) ---------------------------
    @property
    def working_to_master_param(self) -> dict[int, torch.Tensor]:
        """``id(working param)`` -> the 1-D master elements of it this rank holds (views)."""
        return self._master_maps().working_to_master

    @property
    def master_to_working_param(self) -> dict[int, torch.Tensor]:
        """``id(master view)`` (from :attr:`working_to_master_param`) -> the working param."""
        return self._master_maps().master_to_working

    def _master_maps(self) -> MasterMaps:
        maps: MasterMaps | None = getattr(self, "_maps", None)
        if maps is None:
            maps = self._maps = MasterMaps(self)
        return maps

    def get_param_padding_size(self, param: torch.Tensor) -> int:
        """Zero elements the flat layout adds after ``param`` (a bucket's last param only).

        Raises:
            ValueError: ``param`` is not trained by this optimizer.
        """
        return padding_after(*find_slot(self, param))

    def get_param_grad(self, working_param: torch.Tensor) -> torch.Tensor | None:
        """The whole averaged, unscaled gradient of ``working_param`` (collective over dp).

        What DDP would leave in ``param.grad``; None when no backward ran since the last step.

        Raises:
            ValueError: ``working_param`` is not trained by this optimizer.
        """
        return full_param_grad(self, working_param)

    def _finish_step(self) -> None:
        for master in self.masters:
            master.grad = None
        self.reducer.reset()
        self._pending_clip = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (working, bucketed and master); zeros under stage 1 if not to None."""
        self.reducer.reset(set_to_none)
        for master in self.masters:
            master.grad = None

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        """Full, unpadded per-parameter states keyed by parameter index (collective).

        World-size agnostic: load it at any data-parallel size. Under fp16/bf16 with master
        weights the fp32 masters are included as the ``"master_param"`` state.
        """
        self.gatherer.wait_all()
        return gather_state_dict(self)

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore what :meth:`state_dict` returned, at any data-parallel size."""
        self.gatherer.wait_all()
        scatter_state_dict(self, state_dict)

    def manages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the working parameters this optimizer updates."""
        if self._managed_ids is None:
            self._managed_ids = {id(s.param) for bucket in self.buckets for s in bucket.slots}
        return id(param) in self._managed_ids

    def sync_masters_from_params(self) -> None:
        """Copy the working parameters into this rank's master shards (local, no collective).

        Call it after changing the working parameters outside :meth:`step` (e.g. loading a
        model checkpoint into them); otherwise the next step overwrites them with the masters.
        """
        self.gatherer.wait_all()
        with torch.no_grad():
            for bucket, master in zip(self.buckets, self.masters, strict=True):
                lo, hi = bucket.shard_range(self.rank, self.world_size)
                master.copy_(self.flat_params[bucket.group][lo:hi])

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds in working params, grads, master params and optimizer states."""
        return MemoryReport.collect(self)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _grad_hook(reducer: GradReducer, bucket: Bucket, slot: Any, _param: torch.Tensor) -> None:
    reducer.on_grad(bucket, slot)


def _tensors(value: torch.Tensor | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    """``value`` as a list of tensors (a single tensor or a sequence of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(t, torch.Tensor) for t in value):
        return list(value)
    raise TypeError(f"{name} must be a tensor or a sequence of tensors, got {type(value).__name__}")


if TYPE_CHECKING:  # a type checker verifies the accumulation contract
    from colossal.core import GradientAccumulator

    def _accumulates(obj: LowLevelZeroOptimizer) -> GradientAccumulator:
        return obj
