"""GeminiOptimizer: the user's optimizer over the chunks' fp32 master shards.

Each rank updates only its shard of every trainable chunk: the user's param groups are
rebuilt over 1-D views of the master shards (:mod:`colossal.gemini.optim.shards`), each view
gets the matching piece of the chunk's reduced gradient shard as ``.grad``, and after the
update every trainable chunk casts its master into its low-precision shard
(``Chunk.update_shard_from_master``). colossal-kernels' Adam optimizers (``HybridAdam``:
CPU-located shards through the CPU kernel, device ones through the fused kernel) take the
loss-scale divisor and the clipping factor in the same pass (``step(div_scale=...)``); any
other torch optimizer gets unscaled gradients first.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core import (
    DynamicGradScaler,
    ImpliedAxes,
    OptimizerWrapper,
    get_accelerator,
    keep_alive,
)
from colossal.core.grad_norm import NormTerm, norm_share, reduce_norm
from colossal.core.io import adopt_optimizer_state
from colossal.core.precision import Precision, ScalerConfig, parse_precision, scaler_config_from
from colossal.gemini.chunk.placements import norm_group, piece_norm_terms
from colossal.gemini.optim.grad_stats import (
    GradStats,
    check_norm_type,
)
from colossal.gemini.optim.shards import MasterView, build_master_views

logger = logging.getLogger(__name__)

__all__ = ["GeminiOptimizer"]

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def _precision_of(module: Any, manager: Any) -> Precision:
    value = getattr(module, "precision", None)
    if value is not None:
        return parse_precision(value)
    dtypes = {c.dtype for c in manager.chunks if c.requires_grad}
    if len(dtypes) > 1:
        raise ValueError(f"trainable chunks hold several dtypes {sorted(map(str, dtypes))}; "
                         "give the module a `precision` attribute")
    return Precision.from_dtype(dtypes.pop()) if dtypes else Precision.FP32


if TYPE_CHECKING:
    from colossal.gemini.ddp.gemini_ddp import GeminiDDP


class _FusedStep(Protocol):
    """An optimizer whose step divides the grads by the loss scale itself (HybridAdam)."""

    def step(
        self,
        closure: None = None,
        div_scale: float = -1.0,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> object: ...


def _step_takes(optim: Optimizer, name: str) -> bool:
    try:
        return name in inspect.signature(optim.step).parameters
    except (TypeError, ValueError):
        return False


class GeminiOptimizer(OptimizerWrapper):
    """Steps the user's optimizer on this rank's fp32 master shards of a Gemini model.

    Build the optimizer over the model's parameters as usual (several param groups with
    their own hyper-parameters are kept), wrap the model in ``GeminiDDP`` and then wrap the
    optimizer here; call :meth:`backward` instead of ``loss.backward()``. Frozen parameters
    (``requires_grad=False``, e.g. LoRA base weights) are left out of the optimizer and get
    no state.

    Under fp16 the loss is multiplied by a dynamic loss scale; a step whose gradients hold an
    inf/NaN on any rank is skipped on every rank (the verdict is agreed), the scale backs off
    and the gradients are dropped. bf16 and fp32 train unscaled. A step that needs the
    overflow verdict (fp16) or the norm (clipping) measures both in one pass over the gradient
    shards and one all-reduce of two numbers over the chunks' group; a bf16/fp32 step without
    clipping measures nothing (as ColossalAI's, :meth:`get_grad_norm` is then ``None``).

    The norm is :mod:`colossal.core.grad_norm`'s over each parameter's placements: those
    recorded on it (a tensor-parallel block, :func:`colossal.core.mark_sharded`), its flat
    range in this rank's chunk shard, and the replicas of extra data parallelism
    (``GeminiDDP(extra_dp_group=...)``, whose gradient shards are averaged first): every
    element counts once, and one all-reduce over the job gives the norm and the verdict.
    ``tp_process_group`` says that parameters without a record are replicated over it.

    Args:
        optim: The optimizer over the original model's parameters; its state must be empty.
        module: The ``GeminiDDP`` model (anything with a ``chunk_manager``, a ``backward``
            and optionally a ``precision``; without one, the trainable chunks' dtype decides).
        initial_scale: fp16 loss scaler: initial scale.
        min_scale: fp16 loss scaler: smallest scale.
        growth_factor: fp16 loss scaler: growth multiplier.
        backoff_factor: fp16 loss scaler: backoff multiplier.
        growth_interval: fp16 loss scaler: clean steps between growths.
        hysteresis: fp16 loss scaler: overflows tolerated before a backoff.
        max_scale: fp16 loss scaler: largest scale.
        max_norm: Clip the gradients to this global norm at every step (0: no clipping).
        norm_type: The norm used for clipping and :meth:`get_grad_norm`.
        verbose: Log skipped steps and scale changes at INFO level.
        scaler_config: The loss scaler settings as one ``ScalerConfig`` (instead of the
            seven keyword settings).
        tp_process_group: The tensor-parallel group that parameters without a placement
            record are replicated over (None: no tensor parallelism, or every parameter
            carries its placements).

    Raises:
        TypeError: ``optim`` is not a torch optimizer, or ``module`` has no chunk manager.
        ValueError: The optimizer has state, holds parameters the module does not manage,
            or a setting is out of range.
    """

    def __init__(
        self,
        optim: Optimizer,
        module: GeminiDDP,
        *,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        verbose: bool = False,
        scaler_config: ScalerConfig | None = None,
        tp_process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(optim)
        manager = getattr(module, "chunk_manager", None)
        if manager is None:
            raise TypeError(f"GeminiOptimizer needs the GeminiDDP model (with a chunk_manager), "
                            f"got {type(module).__name__}; wrap the model in GeminiDDP first")
        if optim.state:
            raise ValueError("the optimizer already has state; wrap it in GeminiOptimizer "
                             "before its first step and restore checkpoints through "
                             "GeminiOptimizer.load_state_dict")
        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or max_norm < 0:
            raise ValueError(f"max_norm={max_norm!r} must be a number >= 0 (0: no clipping)")
        settings = {"initial_scale": initial_scale, "min_scale": min_scale,
                    "growth_factor": growth_factor, "backoff_factor": backoff_factor,
                    "growth_interval": growth_interval, "hysteresis": hysteresis,
                    "max_scale": max_scale}
        config = scaler_config_from(settings, scaler_config, owner="GeminiOptimizer")
        self.module = module
        self.chunk_manager = manager
        self.group = manager.group
        self.tp_group = keep_alive(tp_process_group)
        self.precision = _precision_of(module, manager)
        self.scaler_config = config
        self.scaler = DynamicGradScaler(config) if self.precision.needs_loss_scaling else None
        self.max_norm = float(max_norm)
        self.norm_type = check_norm_type(norm_type)
        self.verbose = bool(verbose)
        self.set_param_names([[manager.name_of(p) if _managed(manager, p) else _unmanaged(p)
                               for p in g["params"]] for g in optim.param_groups])
        self._views = build_master_views(manager, optim.param_groups)
        for group, views in zip(optim.param_groups, self._views, strict=True):
            group["params"] = [v.view for v in views]
        self._chunks = [c for c in manager.chunks if c.requires_grad]
        self._fused_div = _step_takes(optim, "div_scale")
        # colossal-kernels' Adam reads fp16/bf16 gradients given as ``grads=`` and upcasts
        # them in its pass; other optimizers get transient fp32 copies (see _apply).
        self._fused_grads = self._fused_div and _step_takes(optim, "grads")
        self._device = get_accelerator().get_current_device()
        self._stats: GradStats | None = None  # of the gradients waiting for the next step
        # Parameters without a placement record are replicated over tp (counted once).
        self._implied = ImpliedAxes(tp=self.tp_group)
        self._terms: list[list[tuple[int, int, NormTerm]]] | None = None
        self._norm_reduce: ProcessGroup | None = self.group
        self._last_norm: float | None = None
        self._pending_clip: float | None = None

    # ------------------------------------------------------------------ introspection
    @property
    def master_views(self) -> list[MasterView]:
        """This rank's master pieces the optimizer updates, in param-group order."""
        return [v for views in self._views for v in views]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def model_state_memory(self) -> dict[str, dict[str, int]]:
        """This rank's model-state bytes now, by kind and logical location.

        Kinds: the chunks' ``"param_shards"``, ``"gathered_params"``, ``"grad_buffers"``,
        ``"grad_shards"`` and ``"masters"`` (see ``Chunk.memory_by_kind``), the optimizer's
        ``"optimizer_states"`` (tensor states of the master pieces, placed with their chunk's
        master; states on disk are not counted) and their ``"total"``. Each maps
        ``"device"`` and ``"host"`` to bytes. Between backward and step with fp16/bf16 and
        every chunk sharded, the total is the ZeRO-3 mixed-precision ``(2 + 2 + 12) * Psi /
        N`` bytes plus the chunks' padding. Not a collective.
        """
        out = self.chunk_manager.memory_by_kind()
        states = {"device": 0, "host": 0}
        for v in self.master_views:
            loc = v.chunk.master_location
            for t in self.optim.state.get(v.view, {}).values():
                if isinstance(t, torch.Tensor) and t.numel() == v.numel:
                    states[loc] += t.numel() * t.element_size()
        out["optimizer_states"] = states
        out["total"] = {loc: sum(kind[loc] for kind in out.values()) for loc in states}
        return out

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (times the loss scale under fp16) through the Gemini model."""
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss.float())
        self._stats = None
        self.module.backward(loss, *args, **kwargs)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Back-propagate from ``tensor`` given its gradient (scaled under fp16)."""
        if self.scaler is not None:
            grad = grad * self.scaler.scale
        self._stats = None
        self.module.backward_by_grad(tensor, grad, *args, **kwargs)

    # ------------------------------------------------------------------ norm and clipping
    def _reduce_replicas(self) -> None:
        """Average pending gradient shards over the chunks' replicas (extra data parallelism)."""
        reduce = getattr(self.chunk_manager, "reduce_replica_grads", None)
        if reduce is not None:
            reduce()

    def _norm_pieces(self) -> Iterator[tuple[torch.Tensor, NormTerm]]:
        """Each parameter's piece of this rank's gradient shards, with how it counts."""
        if self._terms is None:
            self._norm_reduce = norm_group(self.chunk_manager, self._implied)
            self._terms = piece_norm_terms(self._chunks, self.chunk_manager, self._norm_reduce,
                                           self._implied)
        for chunk, pieces in zip(self._chunks, self._terms, strict=True):
            grad = chunk.grad_shard
            if grad is None:
                continue
            for at, length, term in pieces:
                yield grad[at : at + length], term

    def _grad_stats(self) -> GradStats:
        if self._stats is None:
            self._reduce_replicas()
            share = norm_share(self._norm_pieces(), self.norm_type, device=self._device)
            norm = float(reduce_norm(share, self.norm_type, self._norm_reduce))
            overflow = not math.isfinite(norm)
            self._stats = GradStats(overflow, math.inf if overflow else norm)
        return self._stats

    def _unscaled_norm(self, stats: GradStats) -> float:
        return stats.norm / self.loss_scale if not stats.overflow else math.inf

    def clip_grad_by_norm(self, max_norm: float, norm_type: float | None = None) -> float:
        """Clip the coming step's gradients to the global norm ``max_norm``; return the norm.

        The norm is over every rank's gradient shards (each gradient element counted once),
        equal to ``torch.nn.utils.clip_grad_norm_`` on the whole model's averaged gradients;
        the clip itself is applied inside :meth:`step`, with the unscaling. Collective:
        every rank of the group (and of ``tp_process_group``) must call it.

        Raises:
            ValueError: ``max_norm`` is not positive, or ``norm_type`` differs from the
                optimizer's.
        """
        if norm_type is not None and check_norm_type(norm_type) != self.norm_type:
            raise ValueError(f"norm_type={norm_type} differs from the optimizer's "
                             f"norm_type={self.norm_type}; set norm_type in GeminiOptimizer")
        if isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or max_norm <= 0:
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        self._pending_clip = float(max_norm)
        norm = self._unscaled_norm(self._grad_stats())
        self._last_norm = norm
        return norm

    def get_grad_norm(self, norm_type: float | None = None) -> float | None:
        """The global norm of the last step's gradients (unscaled; ``inf`` on overflow).

        After :meth:`clip_grad_by_norm` it is the norm of the pending gradients; ``None``
        before any step and after a step that measured nothing (bf16/fp32 without clipping).
        Not a collective: it returns what the step measured.
        """
        return self._last_norm

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Not supported: clipping by value changes the norm each rank would agree on.

        Raises:
            NotImplementedError: Always; use ``max_norm`` / :meth:`clip_grad_by_norm`.
        """
        raise NotImplementedError("GeminiOptimizer clips by the global norm only; use "
                                  "max_norm=... or clip_grad_by_norm()")

    # ------------------------------------------------------------------ step
    def step(self, closure: None = None) -> None:
        """Unscale, clip and apply the gradient shards; refresh the low-precision shards.

        Under fp16 a step whose gradients overflowed on any rank is skipped on every rank:
        the loss scale backs off and the gradients are dropped.

        Raises:
            ValueError: A closure was given.
            FloatingPointError: bf16/fp32 gradients hold an inf or NaN, found when clipping
                measured them (the step is skipped and the gradients dropped first).
        """
        if closure is not None:
            raise ValueError("GeminiOptimizer.step does not take a closure")
        self._reduce_replicas()
        max_norm = self._pending_clip or self.max_norm
        if self.scaler is None and max_norm <= 0:
            self._last_norm = None
            self._apply(1.0)
            self._finish()
            return
        stats = self._grad_stats()
        norm = self._unscaled_norm(stats)
        self._last_norm = norm
        # The gradients carry the scale the loss was multiplied by: read it before the scaler
        # grows it (growth_interval reached) or backs it off.
        scaled_by = self.loss_scale
        if self.scaler is not None:
            self.scaler.update(stats.overflow)
        if stats.overflow:
            self.zero_grad()
            if self.scaler is None:
                raise FloatingPointError(f"the {self.precision.value} gradients hold an inf or "
                                         "NaN (on some rank); the step was skipped; check the "
                                         "loss and the learning rate")
            (logger.info if self.verbose else logger.debug)(
                "gradient overflow: step skipped on every rank, loss scale now %g",
                self.scaler.scale)
            return
        divisor = scaled_by
        if max_norm > 0 and max_norm / (norm + _CLIP_EPS) < 1.0:
            divisor *= (norm + _CLIP_EPS) / max_norm
        self._apply(divisor)
        self._finish()

    def _finish(self) -> None:
        refresh = getattr(self.module, "after_optimizer_step", None)
        if callable(refresh):  # GeminiDDP: refreshes every trainable chunk's shard
            refresh()
        else:
            for chunk in self._chunks:
                chunk.update_shard_from_master()
        self.zero_grad()

    def _apply(self, divisor: float) -> None:
        """One step of the user's optimizer on the master views.

        The gradient shards are in the chunk dtype (fp16/bf16 with mixed precision). A fused
        colossal-kernels Adam reads them as they are (``grads=``, upcast inside its pass,
        with the divisor); any other optimizer gets fp32 copies of them, made per chunk for
        this step only, as ``.grad``.
        """
        for v in self.master_views:
            if v.rebind():  # the master moved (placement): its states follow it
                state = self.optim.state.get(v.view, {})
                for key, t in state.items():
                    if isinstance(t, torch.Tensor) and t.numel() == v.numel:
                        state[key] = t.to(v.view.device)
        if self._fused_grads:
            grads = {v.view: v.grad(g) for v in self.master_views
                     if (g := v.chunk.grad_shard) is not None}
            fused = cast(_FusedStep, self.optim)  # _step_takes(optim, "grads") said so
            fused.step(div_scale=divisor if divisor != 1.0 else -1.0, grads=grads)
            return
        upcast: dict[int, torch.Tensor] = {}
        for chunk in self._chunks:
            g = chunk.grad_shard
            if g is not None:
                upcast[chunk.chunk_id] = g if g.dtype == chunk.optim_shard.dtype else \
                    g.to(chunk.optim_shard.dtype)
        for v in self.master_views:
            flat = upcast.get(v.chunk.chunk_id)
            v.view.grad = None if flat is None else v.grad(flat)
        if self._fused_div:
            cast(_FusedStep, self.optim).step(div_scale=divisor if divisor != 1.0 else -1.0)
            return
        if divisor != 1.0:
            with torch.no_grad():
                for flat in upcast.values():  # fp32 copies, or fp32 shards freed after it
                    flat.div_(divisor)
        self.optim.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient shards (and their views) and any pending clip."""
        for v in self.master_views:
            v.view.grad = None
        for chunk in self._chunks:
            chunk.free_grad_shard()
        self._stats = None
        self._pending_clip = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> StateDict:
        """This rank's optimizer states, keyed by parameter name (local shards, not a collective).

        ``"state"`` maps each name this rank holds a piece of to its states (flat tensors of
        the piece) plus ``"range"`` (``[start, stop)`` of the flattened parameter);
        ``"param_groups"`` holds each group's hyper-parameters and its names; ``"loss_scaler"``
        the fp16 scaler's state (``None`` otherwise). Load it at the same world size and
        chunk layout; the resharding checkpoint format is ``colossal.core``'s.
        """
        inner = self.optim.state_dict()
        names = [v.name for v in self.master_views]
        ranges = [(v.start, v.stop) for v in self.master_views]
        state = {names[i]: {**s, "range": ranges[i]} for i, s in inner["state"].items()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[i] for i in g["params"]]} for g in inner["param_groups"]]
        return {"state": state, "param_groups": groups,
                "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore what :meth:`state_dict` returned on this rank.

        Raises:
            ValueError: The number of param groups differs, or a parameter's range differs
                (another world size or chunk layout).
            KeyError: The state dict lacks ``"state"`` or ``"param_groups"``.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self._views):
            raise ValueError(f"the state dict has {len(groups)} param groups, the optimizer "
                             f"{len(self._views)}")
        index: dict[str, int] = {}
        inner_groups = []
        for saved, views in zip(groups, self._views, strict=True):
            ids = []
            for v in views:
                index[v.name] = len(index)
                ids.append(index[v.name])
            inner_groups.append({**{k: x for k, x in saved.items() if k != "params"},
                                 "params": ids})
        ranges = {v.name: (v.start, v.stop) for v in self.master_views}
        inner_state = {}
        for name, s in state_dict["state"].items():
            if name not in index:
                continue
            if tuple(s.get("range", ranges[name])) != ranges[name]:
                raise ValueError(
                    f"the saved state of {name!r} covers elements {tuple(s['range'])}, this rank "
                    f"holds {ranges[name]}; load at the world size and chunk size it was "
                    "saved with")
            inner_state[index[name]] = {k: x for k, x in s.items() if k != "range"}
        # Loaded tensors may be views of the checkpoint file's memory map: copy them into
        # this optimizer's own state tensors (colossal.core.io.adopt).
        self.optim.load_state_dict(adopt_optimizer_state(
            self.optim, {"state": inner_state, "param_groups": inner_groups}))
        scaler_state = state_dict.get("loss_scaler")
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)


def _managed(manager: Any, p: torch.Tensor) -> bool:
    try:
        manager.chunk_of(p)
    except KeyError:
        return False
    return True


def _unmanaged(p: torch.Tensor) -> str:
    raise ValueError(
        f"the optimizer holds a parameter of shape {tuple(p.shape)} that the Gemini module "
        "does not manage; build the optimizer over the parameters of the model given to GeminiDDP"
    )
