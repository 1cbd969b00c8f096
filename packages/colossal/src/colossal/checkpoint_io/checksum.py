"""CRC-32 of checkpoint files: SIMD-fast where zlib-ng is installed, combinable by pieces.

:func:`crc32` is zlib's CRC-32 (the same values as :func:`zlib.crc32`). With the ``zlib-ng``
package (a dependency of ``colossal``) it is several times faster than the standard
library's zlib 1.2 (figures in the CHANGELOG), whose checksum of a rank's share of a
checkpoint would otherwise cost as much CPU as the copy into the page cache (both release
the GIL on large buffers). :func:`crc32_combine` joins the CRCs of consecutive pieces
written by different ranks without reading them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

_zlib: Any
try:
    from zlib_ng import zlib_ng as _zlib_ng

    _zlib = _zlib_ng
except ImportError:  # pragma: no cover - exercised where zlib-ng is not installed
    import zlib

    _zlib = zlib

__all__ = ["crc32", "crc32_combine"]


def crc32(data: Buffer, value: int = 0) -> int:
    """The CRC-32 of the bytes of ``data`` (a bytes-like object), continuing from ``value``."""
    crc: int = _zlib.crc32(data, value)
    return crc


_POLY = 0xEDB88320  # CRC-32 (reflected)


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (reflected bit order: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    """``x^(2^k)`` modulo the polynomial for k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len(B)``.

    zlib's ``crc32_combine``: ``crc1`` shifted by ``8 * len2`` zero bits is ``crc1`` times
    ``x^(8 len2)`` in GF(2)[x] modulo the CRC polynomial, found with O(log len2)
    multiplications by the precomputed ``x^(2^k)``.

    Raises:
        ValueError: ``len2`` is negative.
    """
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    p, k, n = 1 << 31, 3, len2  # x^0; the length is in bytes: 2^3 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)
