"""Attention mask descriptions, and a builder from a Hugging Face ``attention_mask``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class AttnMaskType(str, enum.Enum):
    """Which positions attend to which.

    ``PADDED`` variants carry per-sequence padding masks; ``CAUSAL`` variants let query ``i``
    see keys up to its own position (bottom-right aligned when there are more keys than
    queries, as with a KV cache).
    """

    NONE = "none"
    CAUSAL = "causal"
    PADDED = "padded"
    PADDED_CAUSAL = "padded_causal"
    CUSTOM = "custom"


@dataclass(frozen=True)
class AttentionMask:
    """A mask description for :func:`colossal.kernels.attention`.

    Attributes:
        kind: The mask type.
        q_padding_mask: ``[B, Sq]`` bool, ``True`` for real query tokens (padded kinds).
        kv_padding_mask: ``[B, Sk]`` bool, ``True`` for real key tokens (padded kinds).
        custom: A bool mask (``True`` = may attend) or an additive float mask broadcastable
            to ``[B, H, Sq, Sk]`` (``CUSTOM`` only).

    Raises:
        ValueError: The tensors do not match ``kind``.
    """

    kind: AttnMaskType = AttnMaskType.NONE
    q_padding_mask: torch.Tensor | None = None
    kv_padding_mask: torch.Tensor | None = None
    custom: torch.Tensor | None = None

    def __post_init__(self) -> None:
        kind = AttnMaskType(self.kind)
        object.__setattr__(self, "kind", kind)
        padded = kind in (AttnMaskType.PADDED, AttnMaskType.PADDED_CAUSAL)
        if padded:
            if self.kv_padding_mask is None:
                raise ValueError(f"mask kind {kind.value!r} needs kv_padding_mask ([B, Sk] bool)")
            for name in ("q_padding_mask", "kv_padding_mask"):
                t = getattr(self, name)
                if t is not None and (t.dim() != 2 or t.dtype != torch.bool):
                    raise ValueError(f"{name} must be a [batch, seq] bool tensor, got "
                                     f"{t.dtype} of shape {tuple(t.shape)}")
        elif self.q_padding_mask is not None or self.kv_padding_mask is not None:
            raise ValueError(f"padding masks given for mask kind {kind.value!r}; use 'padded' "
                             "or 'padded_causal'")
        if (kind == AttnMaskType.CUSTOM) != (self.custom is not None):
            raise ValueError("pass custom=<mask tensor> exactly when kind is 'custom'")

    @property
    def is_causal(self) -> bool:
        """Whether the mask includes the causal constraint."""
        return self.kind in (AttnMaskType.CAUSAL, AttnMaskType.PADDED_CAUSAL)


def make_attention_mask(attention_mask: torch.Tensor | None = None, *, is_causal: bool = True,
                        q_len: int | None = None) -> AttentionMask:
    """Build an :class:`AttentionMask` from a Hugging Face style ``attention_mask``.

    Args:
        attention_mask: ``None``; a ``[B, Sk]`` tensor with 1 for tokens and 0 for padding
            (left or right padding); or a 4-D mask (bool, or additive float as prepared by
            Hugging Face models), used as a custom mask.
        is_causal: Decoder (causal) attention.
        q_len: Number of queries when fewer than keys (decoding with a KV cache); the queries
            are the last ``q_len`` positions.

    Returns:
        ``NONE``/``CAUSAL`` when there is no padding at all (fastest kernels), otherwise the
        padded kind with bool padding masks.

    Raises:
        ValueError: ``attention_mask`` has an unsupported shape, or ``q_len`` is too large.
    """
    if attention_mask is None:
        return AttentionMask(AttnMaskType.CAUSAL if is_causal else AttnMaskType.NONE)
    if attention_mask.dim() == 4:
        return AttentionMask(AttnMaskType.CUSTOM, custom=attention_mask)
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)} is not supported; pass a "
            "[batch, seq] 0/1 padding mask or a 4-D [batch, heads, q, k] mask"
        )
    kv = attention_mask.bool()
    sk = kv.shape[1]
    q_len = sk if q_len is None else q_len
    if not 0 < q_len <= sk:
        raise ValueError(f"q_len={q_len} must be in [1, {sk}] (the mask's sequence length)")
    if bool(kv.all()):
        return AttentionMask(AttnMaskType.CAUSAL if is_causal else AttnMaskType.NONE)
    kind = AttnMaskType.PADDED_CAUSAL if is_causal else AttnMaskType.PADDED
    return AttentionMask(kind, q_padding_mask=kv[:, sk - q_len:], kv_padding_mask=kv)


def dense_bool_mask(mask: AttentionMask, sq: int, sk: int, device: torch.device
                    ) -> torch.Tensor | None:
    """The mask as a bool tensor broadcastable to ``[B, 1, Sq, Sk]`` (``None`` for NONE).

    Rows where no key may be attended (padded queries) are left all ``True`` so that no
    kernel produces NaN; :func:`~colossal.kernels.attention` zeroes those outputs.
    """
    if mask.kind == AttnMaskType.NONE:
        return None
    if mask.kind == AttnMaskType.CUSTOM:
        assert mask.custom is not None
        return mask.custom
    allowed: torch.Tensor | None = None
    if mask.is_causal:
        i = torch.arange(sq, device=device).view(sq, 1)
        j = torch.arange(sk, device=device).view(1, sk)
        allowed = (j <= i + (sk - sq)).view(1, 1, sq, sk)
    if mask.kv_padding_mask is not None:
        kv = mask.kv_padding_mask.to(device).view(-1, 1, 1, sk)
        allowed = kv if allowed is None else allowed & kv
    assert allowed is not None
    empty = ~allowed.any(dim=-1, keepdim=True)
    return allowed | empty
