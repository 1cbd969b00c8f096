"""Norm modules over the fused kernels, and a helper that swaps them into a model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from colossal.core import get_logger
from colossal.kernels.norm.functional import fused_layer_norm, fused_rms_norm

logger = get_logger(__name__)

# RMSNorm classes whose forward is not ``x * rstd * weight`` (Gemma scales by 1 + weight).
_INCOMPATIBLE_RMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class FusedLayerNorm(nn.Module):
    """Drop-in ``torch.nn.LayerNorm`` running the fused kernel (Triton on GPU, ATen on CPU).

    Args:
        normalized_shape: Trailing dimensions to normalize.
        eps: Added to the variance.
        elementwise_affine: Learn a weight (and bias).
        bias: Learn a bias (with ``elementwise_affine``).
        device: Parameter device.
        dtype: Parameter dtype.
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight = (nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
                       if elementwise_affine else None)
        self.bias = (nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
                     if elementwise_affine and bias else None)

    @classmethod
    def from_native_module(cls, module: nn.LayerNorm) -> FusedLayerNorm:
        """A :class:`FusedLayerNorm` sharing ``module``'s weight and bias parameters.

        Raises:
            TypeError: ``module`` is not a ``torch.nn.LayerNorm``.
        """
        if not isinstance(module, nn.LayerNorm):
            raise TypeError(f"expected torch.nn.LayerNorm, got {type(module).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(module.normalized_shape)
        new.eps = module.eps
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        new.bias = module.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the trailing ``normalized_shape`` dimensions of ``x``."""
        return fused_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        """Shape, eps and affine flag for ``repr``."""
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class FusedRMSNorm(nn.Module):
    """RMSNorm (``x * rsqrt(mean(x**2) + eps) * weight``, statistics in fp32), fused.

    Replaces ``torch.nn.RMSNorm`` and Hugging Face ``LlamaRMSNorm``-style modules.

    Output dtype: the input's (as ``torch.nn.RMSNorm``), or with ``hf_output_dtype`` as in
    Hugging Face's ``weight * normalized.to(input_dtype)``: the promotion of the weight's and
    the input's dtypes (e.g. fp32 for a bf16 input and an fp32 weight). Both agree when the
    weight has the input's dtype.

    Args:
        normalized_shape: Trailing dimensions to normalize (the hidden size).
        eps: Added to the mean square.
        elementwise_affine: Learn a weight.
        device: Parameter device.
        dtype: Parameter dtype.
        hf_output_dtype: Follow Hugging Face's output dtype rule (set by
            :meth:`from_native_module` for Hugging Face modules).
    """

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6,
                 elementwise_affine: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, hf_output_dtype: bool = False) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.hf_output_dtype = hf_output_dtype
        self.weight = (nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
                       if elementwise_affine else None)

    @classmethod
    def from_native_module(cls, module: nn.Module) -> FusedRMSNorm:
        """A :class:`FusedRMSNorm` sharing ``module``'s weight parameter.

        Accepts ``torch.nn.RMSNorm`` (``eps=None`` becomes ``torch.finfo(dtype).eps`` as in
        torch) and Hugging Face RMSNorms with ``weight`` and ``variance_epsilon``/``eps``.

        Raises:
            TypeError: ``module`` is not a compatible RMSNorm.
        """
        name = type(module).__name__
        weight = getattr(module, "weight", None)
        hf = not isinstance(module, nn.RMSNorm)
        eps: float
        if isinstance(module, nn.RMSNorm):
            shape = tuple(module.normalized_shape)
            if module.eps is not None:
                eps = module.eps
            else:
                eps = torch.finfo(weight.dtype if weight is not None else torch.float32).eps
        elif (name.endswith("RMSNorm") and name not in _INCOMPATIBLE_RMS
              and isinstance(weight, torch.Tensor)
              and (hasattr(module, "variance_epsilon") or hasattr(module, "eps"))):
            shape = tuple(weight.shape)
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 0.0))  # one exists
        else:
            raise TypeError(
                f"{name} is not a compatible RMSNorm (need torch.nn.RMSNorm or a module with "
                "'weight' and 'variance_epsilon'/'eps' computing x * rsqrt(mean(x^2)+eps) * w)"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = shape
        new.eps = float(eps)
        new.elementwise_affine = weight is not None
        new.hf_output_dtype = hf
        new.weight = weight
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the trailing ``normalized_shape`` dimensions of ``x``."""
        w = self.weight
        if self.hf_output_dtype and w is not None and w.dtype != x.dtype:
            # Hugging Face: weight * normalized.to(input_dtype), in the promoted dtype
            return w * fused_rms_norm(x, self.normalized_shape, None, self.eps)
        return fused_rms_norm(x, self.normalized_shape, w, self.eps)

    def extra_repr(self) -> str:
        """Shape, eps and affine flag for ``repr``."""
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, "
                f"hf_output_dtype={self.hf_output_dtype}")


def replace_norms(model: nn.Module) -> int:
    """Swap every LayerNorm/RMSNorm in ``model`` for its fused module, in place.

    Parameters are shared, not copied, so optimizers and tied weights keep working. Modules
    that cannot be replaced safely (e.g. Gemma's ``1 + weight`` RMSNorm) are left alone.

    Returns:
        How many modules were replaced.
    """
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if type(child) is nn.LayerNorm:
                new = FusedLayerNorm.from_native_module(child)
            elif isinstance(child, (FusedLayerNorm, FusedRMSNorm)):
                continue
            elif type(child).__name__.endswith("RMSNorm"):
                try:
                    new = FusedRMSNorm.from_native_module(child)
                except TypeError as exc:
                    logger.debug("not replacing %s: %s", child_name, exc)
            if new is not None:
                new.train(child.training)
                setattr(parent, child_name, new)
                count += 1
    return count
