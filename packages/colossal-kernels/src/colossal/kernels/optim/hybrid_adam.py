"""HybridAdam: CPU params through the CPU kernel, accelerator params through FusedAdam's."""

from __future__ import annotations

import torch

from colossal.kernels.optim._base import AdamFn
from colossal.kernels.optim.cpu_adam import CPUAdam
from colossal.kernels.registry import REGISTRY


class HybridAdam(CPUAdam):
    """Adam/AdamW for params spread over CPU and GPU (Gemini, offloaded ZeRO).

    CPU params are updated by the ``cpu_adam`` kernel, other params by the ``fused_adam``
    kernel (Triton multi-tensor on GPU), with the same ``step(div_scale=...)`` contract,
    working copies and state dict as :class:`CPUAdam`. ``nvme_offload_fraction`` of the CPU
    params' state lives on disk and is prefetched while earlier params update; results are
    identical to no offload. Arguments as :class:`CPUAdam` (mirrors ColossalAI's
    ``HybridAdam``).
    """

    def _kernel_for(self, device: torch.device) -> AdamFn:
        if device.type == "cpu":
            return REGISTRY.get("cpu_adam", "cpu")
        return REGISTRY.get("fused_adam", device)
