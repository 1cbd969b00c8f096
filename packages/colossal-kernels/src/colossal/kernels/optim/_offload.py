"""NVMe offload scheduling for the Adam optimizers.

Which params' state lives on disk, and a step that overlaps in-memory compute with the
state's IO.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from colossal.core import get_logger
from colossal.kernels.optim._functional import AdamHyper
from colossal.kernels.optim._nvme import NVMeStateStore, StatePipeline, piece_views
from colossal.kernels.optim._nvme_layout import Unit

if TYPE_CHECKING:
    from colossal.kernels.optim._base import AdamFn, _Entry

logger = get_logger(__name__)

# Compute may take this many times the IO time on one core fewer before all cores compute
# (and the IO thread preempts OpenMP threads): see NVMeOffloadMixin._offload_threads.
_OVERSUBSCRIBE_COST = 1.25


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


class NVMeOffloadMixin(Optimizer):
    """The NVMe offload half of :class:`~colossal.kernels.optim._base.AdamBase`.

    Owns the state store, the choice of offloaded params, the offloaded step (compute of the
    in-memory params interleaved with the state IO) and the state-dict round trip of the
    offloaded states. The Adam half provides ``_kernel_for``, ``_update`` and ``_init_state``.
    """

    _store: NVMeStateStore | None
    _broken: str | None

    def _init_offload(
        self, fraction: float, directory: str | None, direct_io: bool | None
    ) -> None:
        self.nvme_offload_fraction = float(fraction)
        self.nvme_offload_dir = directory
        self._store = None
        self._offload_keys: dict[torch.Tensor, int] = {}
        self._planned: set[torch.Tensor] = set()
        self._io_mark = 0.0  # store.io_cpu_seconds at the start of the last offloaded step
        self._compute_core_s: float | None = None  # last offloaded step's compute core-seconds
        if self.nvme_offload_fraction > 0.0:
            self._store = NVMeStateStore(directory, direct_io=direct_io)

    # Provided by the Adam half.
    def _kernel_for(self, device: torch.device) -> AdamFn:
        raise NotImplementedError

    def _update(self, device: torch.device, hyper: AdamHyper, entries: list[_Entry],
                num_threads: int | None = None) -> None:
        raise NotImplementedError

    def _init_state(self, entry: _Entry) -> None:
        raise NotImplementedError

    # ---- the offloaded step ---------------------------------------------------------------
    def _step_offloaded(self, batches: list[tuple[AdamHyper, torch.device, list[_Entry]]],
                        offloaded: list[tuple[AdamHyper, _Entry]]) -> None:
        """Step with offloaded state so that compute overlaps the state IO.

        Accelerator params first (asynchronous), then the CPU params' in-memory slices
        interleaved with the offloaded ones.
        """
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

    def _mark_broken(self) -> None:
        """After an error inside a step: the state on disk is lost; remove its files."""
        if self._store is not None:
            self._broken = ("the NVMe-offloaded optimizer state was removed after an error "
                            "in an earlier step; rebuild the optimizer (or load a checkpoint)")
            self._store.close()

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

    # ---- planning -------------------------------------------------------------------------
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
        slowest thread, so oversubscribing the cores slows the whole region). Only when
        compute on one core fewer would take clearly longer than the IO (by more than that
        cost, ``_OVERSUBSCRIBE_COST``) do all cores compute. The choice uses the previous
        step's measurements: the IO thread's CPU time (little when the device, not the CPU,
        is the bottleneck, as with ``O_DIRECT``, so then all cores compute) and the compute
        core-seconds (measured with a core left free). With direct IO all cores compute: the
        step waits for the device either way, and finishing compute sooner shortens the time
        it slows the device down. The measurements behind these rules are in the package's
        CHANGELOG.
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
