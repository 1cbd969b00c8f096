"""What CPUAdam, HybridAdam and FusedAdam share: validation, state, working copies, offload."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from colossal.core.logging import get_logger
from colossal.kernels.optim._functional import AdamHyper, check_adam_tensors
from colossal.kernels.optim._nvme import NVMeStateStore, StatePipeline, piece_views
from colossal.kernels.optim._nvme_layout import Unit

logger = get_logger(__name__)

AdamFn = Callable[..., None]


@dataclass
class _Entry:
    param: torch.Tensor
    grad: torch.Tensor
    copy: torch.Tensor | None
    state: dict[str, Any]


# Compute may take this many times the IO time on one core fewer before all cores compute
# (and the IO thread preempts OpenMP threads): see AdamBase._offload_threads.
_OVERSUBSCRIBE_COST = 1.25


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


def _split_by_numel(batches: list[tuple[AdamHyper, torch.device, list[_Entry]]], parts: int
                    ) -> list[list[tuple[AdamHyper, list[_Entry]]]]:
    """Cut the entries into ``parts`` consecutive slices of about equal element counts."""
    total = sum(e.param.numel() for _, _, es in batches for e in es)
    slices: list[list[tuple[AdamHyper, list[_Entry]]]] = [[] for _ in range(parts)]
    seen = 0
    for hyper, _, entries in batches:
        for e in entries:
            idx = min(parts - 1, int(parts * seen / total)) if total else 0
            seen += e.param.numel()
            part = slices[idx]
            if part and part[-1][0] is hyper:
                part[-1][1].append(e)
            else:
                part.append((hyper, [e]))
    return slices


class AdamBase(Optimizer):
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
        self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
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
        self.nvme_offload_fraction = float(nvme_offload_fraction)
        self.nvme_offload_dir = nvme_offload_dir
        self._working: dict[torch.Tensor, torch.Tensor] = {}
        self._store: NVMeStateStore | None = None
        self._offload_keys: dict[torch.Tensor, int] = {}
        self._planned: set[torch.Tensor] = set()
        self._broken: str | None = None
        self._io_mark = 0.0  # store.io_cpu_seconds at the start of the last offloaded step
        self._compute_core_s: float | None = None  # last offloaded step's compute core-seconds
        if self.nvme_offload_fraction > 0.0:
            self._store = NVMeStateStore(nvme_offload_dir, direct_io=nvme_direct_io)

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

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, div_scale: float = -1.0,
             grads: Mapping[torch.Tensor, torch.Tensor] | None = None) -> Any:
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
                entry = _Entry(p, grad.reshape(-1), self._working.get(p), self.state[p])
                check_adam_tensors([p], [entry.grad], [entry.copy])
                if not p.is_contiguous():
                    raise ValueError("Adam kernels need contiguous params; call .contiguous()")
                if p in self._offload_keys:
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
            # Accelerator params first (asynchronous), then CPU params in-memory slices
            # interleaved with the offloaded ones, so that compute overlaps the state IO.
            for hyper, device, entries in batches:
                if device.type != "cpu":
                    self._update(device, hyper, entries)
            cpu_batches = [(h, d, es) for h, d, es in batches if d.type == "cpu"]
            by_key = {self._offload_keys[e.param]: (h, e) for h, e in offloaded}
            assert self._store is not None
            units = list(self._store.layout.units_of(set(by_key)))
            slices = _split_by_numel(cpu_batches, len(units) + 1)
            cpu = torch.device("cpu")
            threads = self._offload_threads()
            started = time.perf_counter()

            def run_slice(i: int) -> None:
                for hyper, entries in slices[i]:
                    self._update(cpu, hyper, entries, threads)

            kernel = self._kernel_for(cpu)
            for _, e in offloaded:
                self._init_state(e)
                e.state["step"] = int(e.state["step"]) + 1
            pipeline = StatePipeline(self._store, units, before_wait=run_slice)
            for _, unit, buf in pipeline:
                self._update_unit(kernel, unit, buf, by_key, threads)
            run_slice(len(units))
            if threads is not None:  # compute alone on its cores: a clean measurement
                busy = time.perf_counter() - started - pipeline.waited
                self._compute_core_s = busy * threads
        except BaseException:
            if self._store is not None:
                self._broken = ("the NVMe-offloaded optimizer state was removed after an error "
                                "in an earlier step; rebuild the optimizer (or load a checkpoint)")
                self._store.close()
            raise
        return loss

    def _update(self, device: torch.device, hyper: AdamHyper, entries: list[_Entry],
                num_threads: int | None = None) -> None:
        if entries:
            self._kernel_for(device)(
                [e.param for e in entries], [e.grad for e in entries],
                [e.state["exp_avg"] for e in entries], [e.state["exp_avg_sq"] for e in entries],
                [e.copy for e in entries], [e.state["step"] for e in entries], hyper,
                num_threads=num_threads,
            )

    @staticmethod
    def _update_unit(kernel: AdamFn, unit: Unit, buf: torch.Tensor,
                     by_key: Mapping[int, tuple[AdamHyper, _Entry]], threads: int | None) -> None:
        """Update the pieces of ``unit`` (loaded in ``buf``) whose params have grads.

        One kernel call per run of pieces with the same hyper-parameters.
        """
        todo = [(by_key[p.key], p) for p in unit.pieces if p.key in by_key]
        for hyper, run in itertools.groupby(todo, key=lambda item: item[0][0]):
            pieces = [(e, p, piece_views(buf, p)) for (_, e), p in run]
            kernel([e.param.view(-1)[p.start : p.stop] for e, p, _ in pieces],
                   [e.grad[p.start : p.stop] for e, p, _ in pieces],
                   [m for _, _, (m, _) in pieces], [v for _, _, (_, v) in pieces],
                   [None if e.copy is None else e.copy.view(-1)[p.start : p.stop]
                    for e, p, _ in pieces],
                   [e.state["step"] for e, _, _ in pieces], hyper, num_threads=threads)

    def _init_state(self, entry: _Entry) -> None:
        state = entry.state
        if "step" not in state:
            state["step"] = 0
        if entry.param not in self._offload_keys and "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(entry.param, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(entry.param,
                                                   memory_format=torch.contiguous_format)

    # ---- NVMe offload -------------------------------------------------------------------
    def _plan_offload(self) -> None:
        """Pick which CPU params keep their state on disk (once per param)."""
        if self._store is None:
            return
        new = [p for g in self.param_groups for p in g["params"]
               if p not in self._planned and p.device.type == "cpu"]
        if not new:
            return
        target = self.nvme_offload_fraction * sum(p.numel() for p in new)
        chosen = 0
        moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in new:
            self._planned.add(p)
            if chosen + p.numel() / 2 <= target:
                chosen += p.numel()
                key = self._offload_keys[p] = len(self._offload_keys)
                self._store.add(key, p.numel())
                state = self.state.get(p)
                if state and "exp_avg" in state:  # state created before planning: move it
                    moved[key] = (state.pop("exp_avg"), state.pop("exp_avg_sq"))
        if moved:
            self._store.write_states(moved)
        logger.debug("NVMe offload: %d of %d params (%d elements)", len(self._offload_keys),
                     len(new), chosen)

    def _offload_threads(self) -> int | None:
        """Compute threads for a step with offloaded state (``None``: all of them).

        Buffered file IO is CPU work (the kernel copies to and from the page cache) done by
        one IO thread. When that thread would be the bottleneck anyway, compute runs on one
        core fewer, so it never preempts an OpenMP thread (an OpenMP region waits for its
        slowest thread; oversubscribing the 2 benchmark cores cost about 10 ms of an 80 ms
        step). Only when compute on one core fewer would take clearly longer than the IO
        (by more than that cost) do all cores compute. The choice uses the previous step's
        measurements: the IO thread's CPU time (little when the device, not the CPU, is the
        bottleneck, as with ``O_DIRECT``, so then all cores compute) and the compute
        core-seconds (measured with a core left free). With direct IO on the 2-core benchmark
        VM, all cores computing measured about 3% faster than leaving one to the IO thread
        (the step waits for the device either way; finishing compute sooner shortens the
        time it slows the virtual disk down).
        """
        assert self._store is not None
        n = torch.get_num_threads()
        io_s = self._store.io_cpu_seconds - self._io_mark
        self._io_mark = self._store.io_cpu_seconds
        if n < 2:
            return None
        core_s = self._compute_core_s
        if core_s is None or _OVERSUBSCRIBE_COST * io_s * (n - 1) >= core_s:
            return n - 1
        return None

    @property
    def offloaded_params(self) -> list[torch.Tensor]:
        """Params whose optimizer state lives on disk."""
        return list(self._offload_keys)

    def close(self) -> None:
        """Delete the NVMe state files (the optimizer cannot step with offload afterwards)."""
        if self._store is not None and not self._store.closed:
            self._store.close()
            self._broken = "the optimizer was closed; its NVMe-offloaded state was removed"

    def __enter__(self) -> AdamBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- state dict ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Like ``torch.optim.AdamW``'s: offloaded states are read back from disk."""
        sd = super().state_dict()
        if not self._offload_keys:
            return sd
        assert self._store is not None
        keys = {p: k for p, k in self._offload_keys.items() if "step" in self.state.get(p, {})}
        states = self._store.read_states(list(keys.values()))
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p in keys:
                    exp_avg, exp_avg_sq = states[keys[p]]
                    sd["state"][index] = {**sd["state"][index], "exp_avg": exp_avg.view_as(p),
                                          "exp_avg_sq": exp_avg_sq.view_as(p)}
                index += 1
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (from any of these optimizers or ``torch.optim.AdamW``)."""
        super().load_state_dict(state_dict)
        if self._store is None:
            return
        moved = {}
        for p, key in self._offload_keys.items():
            state = self.state.get(p)
            if state and "exp_avg" in state:
                moved[key] = (state.pop("exp_avg"), state.pop("exp_avg_sq"))
        self._store.write_states(moved)
