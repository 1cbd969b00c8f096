"""Float8 encoding of communication payloads: scaled float8 values and their scales as bytes.

A payload of ``n`` elements is cut into blocks (one block per tensor by default, or blocks of
``block_size`` elements); each block is divided by its scale ``amax / fp8_max`` (``amax``: the
block's largest magnitude) and rounded to float8. The encoded form is one flat ``uint8``
tensor: the ``n`` float8 bytes, then the float32 scales' bytes. gloo has no float8 dtype,
so the bytes travel as ``uint8``.

Error bound (:meth:`Fp8Codec.error_bound`): rounding to a float8 format with machine epsilon
``eps`` (``2^-3`` for e4m3, ``2^-2`` for e5m2) errs by at most ``eps / 2`` relative for values in
the normal range, and by at most half the subnormal spacing ``tiny * eps / 2`` (in scaled units)
below it; after scaling back, an element ``x`` of a block with scale ``s`` is off by at most
``eps / 2 * |x| + tiny * eps / 2 * s``. A non-finite value in a block makes the whole block
decode as NaN (so an fp16 overflow check still sees it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_FORMATS: dict[str, torch.dtype] = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
"""The float8 formats by name: e4m3 (more precision, max 448), e5m2 (more range, max 57344)."""

_SCALE_BYTES = 4  # float32 scales


@dataclass(frozen=True)
class Fp8Codec:
    """How payloads are encoded: the float8 format and the scaling granularity.

    Args:
        fmt: ``"e4m3"`` (default; ColossalAI's forward format) or ``"e5m2"``.
        block_size: Elements per scale; ``None`` scales each encoded piece as one block.

    Raises:
        ValueError: an unknown ``fmt`` or a ``block_size`` that is not a positive int.
    """

    fmt: str = "e4m3"
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FP8_FORMATS:
            raise ValueError(
                f"fp8 format {self.fmt!r} is unknown; use one of {sorted(FP8_FORMATS)}"
            )
        if self.block_size is not None and (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise ValueError(
                f"block_size={self.block_size!r} must be a positive int (or None: one scale "
                "per tensor)"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The float8 dtype."""
        return FP8_FORMATS[self.fmt]

    @property
    def fp8_max(self) -> float:
        """Largest finite value of the format."""
        return float(torch.finfo(self.dtype).max)

    def num_scales(self, n: int) -> int:
        """Scales of a piece of ``n`` elements (at least one)."""
        if self.block_size is None or n == 0:
            return 1
        return -(-n // self.block_size)

    def encoded_size(self, n: int) -> int:
        """Bytes of an encoded piece of ``n`` elements: ``n`` + 4 per scale."""
        return n + _SCALE_BYTES * self.num_scales(n)

    def _blocks(self, n: int) -> int:
        return n if self.block_size is None else min(self.block_size, max(n, 1))

    def scales(self, flat: torch.Tensor) -> torch.Tensor:
        """The float32 scale of each block of the flat tensor ``flat``."""
        n = flat.numel()
        nb, block = self.num_scales(n), self._blocks(n)
        x = flat.detach().to(torch.float32)
        if nb * block != n:
            x = torch.nn.functional.pad(x, (0, nb * block - n))
        amax = x.view(nb, block).abs().amax(dim=1) if n else torch.zeros(1, device=x.device)
        scale = amax / self.fp8_max
        return torch.where(scale == 0, torch.ones_like(scale), scale)

    def encode(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The flat ``uint8`` encoding of ``tensor`` (``out``, when given, receives it)."""
        flat = tensor.reshape(-1)
        n = flat.numel()
        scale = self.scales(flat)
        size = self.encoded_size(n)
        if out is None:
            out = torch.empty(size, dtype=torch.uint8, device=tensor.device)
        elif out.numel() != size or out.dtype != torch.uint8:
            raise ValueError(
                f"encode: out must be a uint8 tensor of {size} bytes, got {out.numel()} "
                f"{out.dtype} elements"
            )
        per_elem = self._expand(scale, n)
        scaled = (flat.to(torch.float32) / per_elem).clamp_(-self.fp8_max, self.fp8_max)
        out[:n].copy_(scaled.to(self.dtype).view(torch.uint8))
        out[n:].copy_(scale.view(torch.uint8))
        return out

    def decode(
        self, encoded: torch.Tensor, n: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The ``n`` values of an encoded piece, as a flat tensor of ``dtype``."""
        if encoded.numel() != self.encoded_size(n):
            raise ValueError(
                f"decode: {encoded.numel()} bytes cannot hold {n} encoded elements "
                f"({self.encoded_size(n)} bytes)"
            )
        scale = encoded[n:].clone().view(torch.float32)  # a fresh, aligned copy
        values = encoded[:n].contiguous().view(self.dtype).to(torch.float32)
        return (values * self._expand(scale, n)).to(dtype)

    def _expand(self, scale: torch.Tensor, n: int) -> torch.Tensor:
        if scale.numel() == 1:
            return scale
        return scale.repeat_interleave(self._blocks(n))[:n]

    def error_bound(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per element, the largest error an encode + decode of ``tensor`` may make."""
        flat = tensor.reshape(-1).to(torch.float32)
        info = torch.finfo(self.dtype)
        scale = self._expand(self.scales(flat), flat.numel())
        return (info.eps / 2 * flat.abs() + info.tiny * info.eps / 2 * scale).view(tensor.shape)
