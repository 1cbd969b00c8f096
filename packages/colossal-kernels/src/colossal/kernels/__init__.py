"""colossal-kernels: fused optimizers, norms and attention behind a kernel registry.

* :class:`CPUAdam`, :class:`FusedAdam`, :class:`HybridAdam`: Adam/AdamW with
  ``step(div_scale=...)``, fp16/bf16 working copies written in the same pass, and NVMe
  offload of optimizer state.
* :class:`FusedLayerNorm`, :class:`FusedRMSNorm` (+ functions and :func:`replace_norms`).
* :class:`FusedGELUTanh` (+ :func:`gelu_tanh`, :func:`replace_activations`): GPT-2's composed
  ``gelu_new`` as one kernel.
* :func:`attention` with :class:`AttentionMask` / :func:`make_attention_mask`.
* :func:`cross_entropy`: ``F.cross_entropy`` (class ids, ignore_index, mean/sum/none, an
  explicit divisor) that saves the logits and a per-row log-sum-exp instead of the
  log-probabilities: one ``[tokens, vocab]`` float32 tensor less between forward and backward.
* :data:`REGISTRY`, :func:`kernel_report`, :func:`format_kernel_report`: which
  implementation each kernel uses and why.

Nothing is compiled or imported from optional packages at import time.
"""

from colossal.kernels.__about__ import __version__
from colossal.kernels._builtin import register_builtin
from colossal.kernels.activation import FusedGELUTanh, gelu_tanh, replace_activations
from colossal.kernels.attention import (
    AttentionMask,
    AttnMaskType,
    attention,
    eager_attention,
    make_attention_mask,
)
from colossal.kernels.loss import cross_entropy
from colossal.kernels.norm import (
    FusedLayerNorm,
    FusedRMSNorm,
    fused_layer_norm,
    fused_rms_norm,
    replace_norms,
)
from colossal.kernels.optim import AdamHyper, CPUAdam, FusedAdam, HybridAdam, torch_adam_step
from colossal.kernels.registry import (
    REGISTRY,
    Availability,
    KernelImpl,
    KernelRegistry,
    KernelStatus,
    format_kernel_report,
    kernel_report,
)

register_builtin()

__all__ = [
    "REGISTRY",
    "AdamHyper",
    "AttentionMask",
    "AttnMaskType",
    "Availability",
    "CPUAdam",
    "FusedAdam",
    "FusedGELUTanh",
    "FusedLayerNorm",
    "FusedRMSNorm",
    "HybridAdam",
    "KernelImpl",
    "KernelRegistry",
    "KernelStatus",
    "__version__",
    "attention",
    "cross_entropy",
    "eager_attention",
    "format_kernel_report",
    "fused_layer_norm",
    "fused_rms_norm",
    "gelu_tanh",
    "kernel_report",
    "make_attention_mask",
    "replace_activations",
    "replace_norms",
    "torch_adam_step",
]
