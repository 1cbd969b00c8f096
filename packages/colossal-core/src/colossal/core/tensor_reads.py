"""Which torch functions read a tensor's payload, for modes that guard incomplete tensors.

A ``TorchFunctionMode`` that waits for (or gathers) a parameter before it is used should not
do so for attribute reads that only look at metadata: code often reads ``weight.dtype`` or
``weight.device`` long before it reads the values.
"""

from __future__ import annotations

import torch

__all__ = ["METADATA_GETTERS"]

#: Getters of ``torch.Tensor`` attributes that never read the payload.
METADATA_GETTERS = frozenset(
    getattr(torch.Tensor, name).__get__
    for name in ("dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad", "layout",
                 "is_cuda", "is_meta", "is_sparse", "is_quantized", "name", "_version")
    if hasattr(torch.Tensor, name)
)
