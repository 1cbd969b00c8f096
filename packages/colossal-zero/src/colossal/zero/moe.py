"""ZeRO for mixture-of-experts models: experts over their own data-parallel group.

Under expert parallelism (``ep``) each group of ``ep`` data-parallel ranks holds one copy of
every expert, ``E / ep`` per rank, and ``moe_dp = dp / ep`` ranks hold the same experts. The
dense parameters are ZeRO-sharded and averaged over ``dp``, the experts over ``moe_dp``
(ColossalAI's ``moe_dp_group``). An expert's gradient already sums the tokens of its ``ep``
ranks (the all-to-all's backward brings them home), so it is divided by ``moe_dp * ep = dp``:
both kinds end as the gradient of the mean loss over the global batch.

:class:`MoeLowLevelZeroOptimizer` runs two :class:`LowLevelZeroOptimizer`, one per kind, with
one backward, one gradient norm (each element counted once: the experts' norm is reduced over
the job along their ``ep`` and ``moe_dp`` placements), one clipping factor and, under fp16, one
overflow verdict. Every bucket of both is reduced in every backward whether or not its
experts received tokens, so ZeRO-2 cannot hang on an idle expert.

Order of collectives: the dense part may reduce its buckets during the backward (always in
bucket order, the same on every rank); the expert part reduces only when the backward ends,
after the dense part. An expert's gradient arrives (or not: no tokens, no gradient) at a
point of the backward that differs between ranks, so reducing experts from the gradient
hooks would interleave the two groups' collectives differently on different ranks, which
deadlocks synchronous (shared-memory) collectives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core import OptimizerWrapper, ScalerConfig, shard_spec
from colossal.core.comm import group_ranks
from colossal.zero.optimizer import LowLevelZeroOptimizer, _tensors

__all__ = ["MoeLowLevelZeroOptimizer", "is_expert_param"]

EP_AXIS = "ep"


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert's: its placement record names the ``"ep"`` axis."""
    spec = shard_spec(param)
    return spec is not None and spec.axis(EP_AXIS) is not None


def _ep_size(params: Sequence[torch.Tensor]) -> int:
    """The size of the ``ep`` group the expert parameters are placed along (one for all)."""
    sizes = set()
    for p in params:
        spec = shard_spec(p)
        placement = None if spec is None else spec.axis(EP_AXIS)
        if placement is not None:
            sizes.add(len(group_ranks(placement.group)))
    if len(sizes) > 1:
        raise ValueError(
            f"expert parameters are placed along ep groups of sizes {sorted(sizes)}; "
            "one model has one ep size"
        )
    return sizes.pop() if sizes else 1


def _split_optimizer(
    optimizer: Optimizer, pick: Callable[[torch.Tensor], bool]
) -> tuple[Optimizer | None, list[int]]:
    """An optimizer of ``optimizer``'s class over the picked parameters of each group.

    Returns the optimizer (None when nothing is picked) and, per its group, the index of the
    original group whose hyper-parameters it follows.
    """
    groups: list[dict[str, Any]] = []
    origin: list[int] = []
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if pick(p)]
        if params:
            groups.append({**_hyper(group), "params": params})
            origin.append(index)
    if not groups:
        return None, []
    cls = type(optimizer)
    part = cls.__new__(cls)
    Optimizer.__init__(part, groups, dict(optimizer.defaults))
    return part, origin


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class MoeLowLevelZeroOptimizer(OptimizerWrapper):
    """ZeRO stage 1/2 with the experts' parameters over ``moe_dp``, the rest over ``dp``.

    Use it as :class:`LowLevelZeroOptimizer`: ``optimizer.backward(loss)``, then ``step()``.
    The wrapped optimizer's param groups stay the ones an LR scheduler edits; their
    hyper-parameters are copied to both parts before every step.

    Args:
        optimizer: The optimizer over the model's parameters (its state must be empty).
        moe_dp_process_group: The experts' data-parallel group (ColossalAI's
            ``moe_dp_group``): ranks holding the same experts.
        dp_process_group: The dense parameters' data-parallel group (the whole job when None).
        is_expert: Which parameters are experts' (default: those placed along ``"ep"``,
            :func:`is_expert_param`).
        ep_size: Ranks whose tokens an expert's gradient sums (default: the size of the
            experts' ``ep`` placement group).
        partition_grad: Stage 2 when True, stage 1 otherwise (both parts).
        clip_grad_norm: Clip to this global norm at every step (0 disables).
        norm_type: Norm used for clipping and :meth:`get_grad_norm`.
        scaler_config: The fp16 loss scaler's settings.
        **zero_options: Further :class:`LowLevelZeroOptimizer` keywords (bucket size,
            communication dtype, overlap, offload, master weights, tp/pp groups, verbose).

    Raises:
        ValueError: ``moe_dp`` does not divide the dp group, inconsistent ep groups, or what
            :class:`LowLevelZeroOptimizer` refuses.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        moe_dp_process_group: dist.ProcessGroup | None,
        dp_process_group: dist.ProcessGroup | None = None,
        is_expert: Callable[[torch.Tensor], bool] = is_expert_param,
        ep_size: int | None = None,
        partition_grad: bool = False,
        clip_grad_norm: float = 0.0,
        norm_type: float = 2.0,
        scaler_config: ScalerConfig | None = None,
        **zero_options: object,
    ) -> None:
        super().__init__(optimizer)
        if optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it in MoeLowLevelZeroOptimizer before "
                "its first step"
            )
        experts = [p for g in optimizer.param_groups for p in g["params"] if is_expert(p)]
        ep = _ep_size(experts) if ep_size is None else ep_size
        dp, moe_dp = len(group_ranks(dp_process_group)), len(group_ranks(moe_dp_process_group))
        if experts and moe_dp * ep != dp:
            raise ValueError(
                f"the experts' data-parallel group has {moe_dp} ranks and ep={ep}, but the "
                f"dense data-parallel group has {dp}: moe_dp * ep must equal dp (ParallelDims("
                "ep=...).group('moe_dp') gives the right group)"
            )
        self.ep_size = ep
        self.norm_type = float(norm_type)
        options: dict[str, Any] = {
            "partition_grad": partition_grad,
            "clip_grad_norm": clip_grad_norm,
            "norm_type": norm_type,
            "scaler_config": scaler_config,
        }
        options.update(zero_options)
        self.parts: list[LowLevelZeroOptimizer] = []
        self._origins: list[list[int]] = []
        self.part_groups: list[list[list[int]]] = []
        """Per part, per its param group, the wrapped optimizer's flat index of each param."""
        flat = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        dense, dense_origin = _split_optimizer(optimizer, lambda p: not is_expert(p))
        expert, expert_origin = _split_optimizer(optimizer, is_expert)
        for part in (dense, expert):
            if part is not None:
                self.part_groups.append(
                    [[flat[id(p)] for p in g["params"]] for g in part.param_groups]
                )
        if dense is not None:
            self.parts.append(
                LowLevelZeroOptimizer(dense, dp_process_group=dp_process_group, **options)
            )
            self._origins.append(dense_origin)
        self.expert_optimizer: LowLevelZeroOptimizer | None = None
        if expert is not None:
            self.expert_optimizer = LowLevelZeroOptimizer(
                expert,
                dp_process_group=moe_dp_process_group,
                grad_divisor=moe_dp * ep,
                **{**options, "overlap_communication": False},
            )
            self.parts.append(self.expert_optimizer)
            self._origins.append(expert_origin)
        if not self.parts:
            raise ValueError("the optimizer has no parameters")
        self._grad_norm: float | None = None

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16); the parts keep equal scales."""
        return self.parts[0].loss_scale

    # ---- backward ----------------------------------------------------------------------------
    def backward(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        retain_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Back-propagate ``loss`` (scaled under fp16) once; both parts reduce their buckets."""
        losses = _tensors(loss, "loss")
        scaler = self.parts[0].scaler
        if scaler is not None:
            losses = [scaler.scale_loss(t.float()) for t in losses]
        self._run_backward(losses, None, retain_graph, inputs)

    def backward_by_grad(
        self,
        tensor: torch.Tensor | Sequence[torch.Tensor],
        grad: torch.Tensor | Sequence[torch.Tensor],
        retain_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Back-propagate from ``tensor`` given ``grad`` (already scaled, as in ZeRO)."""
        tensors, grads = _tensors(tensor, "tensor"), _tensors(grad, "grad")
        if len(tensors) != len(grads):
            raise ValueError(
                f"backward_by_grad got {len(tensors)} tensors but {len(grads)} gradients"
            )
        self._run_backward(tensors, grads, retain_graph, inputs)

    def _run_backward(
        self,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor] | None,
        retain_graph: bool,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> None:
        self._grad_norm = None
        for part in self.parts:
            part.reducer.prepare_backward()
        torch.autograd.backward(
            tensors,
            grads,
            retain_graph=retain_graph,
            inputs=None if inputs is None else _tensors(inputs, "inputs"),
        )
        for part in self.parts:
            part._after_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate locally in both parts (stage 1 only, as :class:`LowLevelZeroOptimizer`)."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    @property
    def accumulating(self) -> bool:
        """Whether backwards now accumulate locally (inside :meth:`no_sync`)."""
        return self.parts[0].accumulating

    # ---- norm, clipping, step ----------------------------------------------------------------
    def _compute_norm(self) -> float:
        if self._grad_norm is None:
            norms = [part._compute_norm() for part in self.parts]
            p = self.norm_type
            if math.isinf(p):
                total = max(norms)
            else:
                total = math.fsum(n**p for n in norms) ** (1.0 / p)
            for part in self.parts:  # their step clips and checks overflow by this norm
                part._grad_norm = total
            self._grad_norm = total
        return self._grad_norm

    def clip_grad_by_norm(self, max_norm: float, norm_type: float | None = None) -> float:
        """Clip the coming step's gradients (dense and experts together) to ``max_norm``."""
        for part in self.parts:  # the clip is recorded; its norm is the total's (below)
            part.clip_grad_by_norm(max_norm, norm_type)
        return self._compute_norm()

    def get_grad_norm(self, norm_type: float | None = None) -> float | None:
        """Global norm of the last step's gradients (every parameter, each element once)."""
        return self._grad_norm

    def step(self, closure: None = None) -> None:
        """Step both parts with the one norm (clipping, fp16 overflow skip)."""
        if closure is not None:
            raise ValueError("MoeLowLevelZeroOptimizer.step does not take a closure")
        for part, origin in zip(self.parts, self._origins, strict=True):
            part.gatherer.wait_all()
            for group, index in zip(part.optim.param_groups, origin, strict=True):
                group.update(_hyper(self.optim.param_groups[index]))
        self._compute_norm()
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients of both parts."""
        for part in self.parts:
            part.zero_grad(set_to_none)

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> StateDict:
        """Each part's full state (collective), under ``"dense"`` and ``"expert"``."""
        names = self._part_names()
        return {name: part.state_dict() for name, part in zip(names, self.parts, strict=True)}

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore what :meth:`state_dict` returned (or a checkpoint's indexed state dict).

        A state dict with ``"state"`` and ``"param_groups"`` is keyed by the wrapped
        optimizer's parameter indices and is split between the two parts.
        """
        if "state" in state_dict:
            from colossal.zero.moe_state import split_state_dict

            for part, sd in zip(self.parts, split_state_dict(self, state_dict), strict=True):
                part.load_state_dict(sd)
            return
        for name, part in zip(self._part_names(), self.parts, strict=True):
            if name not in state_dict:
                raise ValueError(
                    f"state_dict has no {name!r} part (keys {sorted(state_dict)}); pass what "
                    "MoeLowLevelZeroOptimizer.state_dict returned"
                )
            part.load_state_dict(state_dict[name])

    def _part_names(self) -> list[str]:
        return ["expert" if part is self.expert_optimizer else "dense" for part in self.parts]

    def manages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the working parameters this optimizer updates."""
        return any(part.manages(param) for part in self.parts)

    def sync_masters_from_params(self) -> None:
        """Copy the working parameters into the master shards of both parts (local)."""
        for part in self.parts:
            part.sync_masters_from_params()

    def wait_params(self) -> None:
        """Block until every parameter is complete (``overlap_allgather``)."""
        for part in self.parts:
            part.wait_params()
