"""What CPUAdam, HybridAdam and FusedAdam share: the Adam step and its kernel dispatch.

Validation, Adam state, working copies, and the step's dispatch of params to the update
kernels per device; NVMe offload scheduling is in :mod:`colossal.kernels.optim._offload`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from colossal.kernels.optim._functional import AdamHyper, check_adam_tensors
from colossal.kernels.optim._offload import NVMeOffloadMixin

AdamFn = Callable[..., None]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The storage a kernel updates: a DTensor's local shard, any other tensor itself.

    FSDP2's parameters, their gradients and the states made like them are DTensors. The
    kernels take raw pointers and element counts, which the wrapper does not have for its shard.
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass
class _Entry:
    param: torch.Tensor
    grad: torch.Tensor
    copy: torch.Tensor | None
    state: dict[str, Any]


def _check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr={lr!r} is invalid; use a learning rate >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(
            f"betas={betas!r} are invalid; use two values in [0, 1), e.g. (0.9, 0.999)"
        )
    if not eps >= 0.0:
        raise ValueError(f"eps={eps!r} is invalid; use eps >= 0 (e.g. 1e-8)")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay={weight_decay!r} is invalid; use weight_decay >= 0")


class AdamBase(NVMeOffloadMixin, Optimizer):
    """Adam/AdamW over fp32 params, with ``step(div_scale=...)``, working copies and offload.

    Subclasses choose the update function per device in :meth:`_kernel_for`.

    Args:
        params: Params or param groups (fp32).
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Moment decay rates.
        eps: Denominator term.
        weight_decay: Weight decay.
        adamw_mode: Decoupled weight decay (AdamW) when true, L2 regularisation otherwise.
        nvme_offload_fraction: Fraction (by elements) of the CPU params' optimizer state that
            lives on disk.
        nvme_offload_dir: Where the state files go (``None``: the system temp directory).
        nvme_direct_io: Move the offloaded state with ``O_DIRECT`` (bypassing the page
            cache: the state really leaves RAM and the IO costs little CPU). ``None``: when the
            filesystem supports it, else buffered IO; ``True``: require it; ``False``: buffered.
        defaults: Extra per-group defaults.
    """

    def __init__(
        self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
        adamw_mode: bool = True, nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None, nvme_direct_io: bool | None = None,
        **defaults: Any,
    ) -> None:
        _check_hyper(lr, tuple(betas), eps, weight_decay)  # type: ignore[arg-type]
        if not 0.0 <= nvme_offload_fraction <= 1.0:
            raise ValueError(
                f"nvme_offload_fraction={nvme_offload_fraction!r} is invalid; use a fraction "
                "in [0, 1] (0 keeps all optimizer state in memory)"
            )
        group_defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas),
                              eps=eps, weight_decay=weight_decay, **defaults)
        super().__init__(params, group_defaults)
        self.adamw_mode = bool(adamw_mode)
        self._working: dict[torch.Tensor, torch.Tensor] = {}
        self._broken: str | None = None
        self._init_offload(nvme_offload_fraction, nvme_offload_dir, nvme_direct_io)

    # ---- working copies -----------------------------------------------------------------
    def attach_working_params(self, mapping: Mapping[torch.Tensor, torch.Tensor]) -> None:
        """Write each master param's updated value into its working copy in the same pass.

        After ``step()``, ``working`` holds ``master`` rounded to ``working.dtype``. A master
        without a ``.grad`` takes its grad from ``working.grad`` (any of fp32/fp16/bf16), so a
        bf16 model's grads feed the fp32 masters without a conversion pass.

        Args:
            mapping: ``{master: working}``; every master must be a param of this optimizer;
                every working copy a contiguous fp32/fp16/bf16 tensor with the same number of
                elements on the same device.

        Raises:
            ValueError: A master is not in the optimizer, or a working copy does not fit.
            TypeError: A working copy has an unsupported dtype.
        """
        known = {p for group in self.param_groups for p in group["params"]}
        for master, working in mapping.items():
            if master not in known:
                raise ValueError(
                    f"master tensor of shape {tuple(master.shape)} is not a param of this "
                    "optimizer; pass the params given to the constructor (or add_param_group)"
                )
            if working.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(
                    f"working copy dtype {working.dtype} unsupported; use fp16/bf16/fp32"
                )
            if (working.numel() != master.numel() or working.device != master.device
                    or not working.is_contiguous()):
                raise ValueError(
                    f"working copy (shape {tuple(working.shape)}, {working.device}) must be "
                    f"contiguous with {master.numel()} elements on {master.device}"
                )
        self._working.update(mapping)

    def detach_working_params(self, masters: Iterable[torch.Tensor] | None = None) -> None:
        """Stop writing working copies (of ``masters``, or of all params)."""
        if masters is None:
            self._working.clear()
        else:
            for m in masters:
                self._working.pop(m, None)

    @property
    def working_params(self) -> dict[torch.Tensor, torch.Tensor]:
        """A copy of the ``{master: working}`` mapping."""
        return dict(self._working)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of the params and of their attached working copies."""
        super().zero_grad(set_to_none=set_to_none)
        for w in self._working.values():
            if w.grad is not None:
                if set_to_none:
                    w.grad = None
                else:
                    w.grad.zero_()

    # ---- stepping -----------------------------------------------------------------------
    def _kernel_for(self, device: torch.device) -> AdamFn:
        raise NotImplementedError

    def _grad_of(self, p: torch.Tensor, grads: Mapping[torch.Tensor, torch.Tensor] | None
                 ) -> torch.Tensor | None:
        if grads is not None and p in grads:
            return grads[p]
        if p.grad is not None:
            return p.grad
        working = self._working.get(p)
        return working.grad if working is not None else None

    @overload
    def step(self, closure: None = None, div_scale: float = -1.0,
             grads: Mapping[torch.Tensor, torch.Tensor] | None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float], div_scale: float = -1.0,
             grads: Mapping[torch.Tensor, torch.Tensor] | None = None) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, div_scale: float = -1.0,
             grads: Mapping[torch.Tensor, torch.Tensor] | None = None) -> float | None:
        """One Adam step over every param that has a grad.

        Args:
            closure: Re-evaluates the model and returns the loss.
            div_scale: When > 0, grads are divided by it (the loss scale) in the same pass.
            grads: Optional ``{param: grad}`` overriding ``param.grad`` (grads may be fp32,
                fp16 or bf16; flattened or shaped like the param).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            TypeError: ``div_scale`` is not a number, or a param/grad has an unsupported dtype.
            RuntimeError: The NVMe state was lost after an error in an earlier step.
        """
        if isinstance(div_scale, bool) or not isinstance(div_scale, (int, float)):
            raise TypeError(
                f"div_scale must be a number (the loss scale, or -1), got {div_scale!r}"
            )
        if self._broken is not None:
            raise RuntimeError(self._broken)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches: list[tuple[AdamHyper, torch.device, list[_Entry]]] = []
        offloaded: list[tuple[AdamHyper, _Entry]] = []
        self._plan_offload()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = AdamHyper(group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                              self.adamw_mode, group["bias_correction"], float(div_scale))
            by_device: dict[torch.device, list[_Entry]] = {}
            for p in group["params"]:
                grad = self._grad_of(p, grads)
                if grad is None:
                    continue
                entry = _Entry(p, _local(grad).reshape(-1), self._working.get(p), self.state[p])
                check_adam_tensors([_local(p)], [entry.grad], [entry.copy])
                if not p.is_contiguous():
                    raise ValueError("Adam kernels need contiguous params; call .contiguous()")
                if p in self._offload_keys:
                    if _local(p) is not p:
                        raise ValueError(
                            f"NVMe offload of a DTensor parameter (shape {tuple(p.shape)}, "
                            "e.g. FSDP2's) is not supported; use nvme_offload_fraction=0 "
                            "with TorchFSDPPlugin, or Gemini / LowLevelZero for NVMe offload"
                        )
                    offloaded.append((hyper, entry))
                else:
                    by_device.setdefault(p.device, []).append(entry)
            batches.extend((hyper, dev, entries) for dev, entries in by_device.items())
        try:
            for _, _, entries in batches:
                for e in entries:
                    self._init_state(e)
                    e.state["step"] = int(e.state["step"]) + 1
            if not offloaded:
                for hyper, device, entries in batches:
                    self._update(device, hyper, entries)
                return loss
            self._step_offloaded(batches, offloaded)
        except BaseException:
            self._mark_broken()
            raise
        return loss

    def _update(self, device: torch.device, hyper: AdamHyper, entries: list[_Entry],
                num_threads: int | None = None) -> None:
        if entries:
            self._kernel_for(device)(
                [_local(e.param) for e in entries], [e.grad for e in entries],
                [_local(e.state["exp_avg"]) for e in entries],
                [_local(e.state["exp_avg_sq"]) for e in entries],
                [e.copy for e in entries], [e.state["step"] for e in entries], hyper,
                num_threads=num_threads,
            )

    def _init_state(self, entry: _Entry) -> None:
        state = entry.state
        if "step" not in state:
            state["step"] = 0
        if entry.param not in self._offload_keys and "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(entry.param, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(entry.param,
                                                   memory_format=torch.contiguous_format)

    def __enter__(self) -> AdamBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
