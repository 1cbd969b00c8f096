"""StateLayout: how offloaded states are packed into fixed-size units of the state file."""

from __future__ import annotations

import pytest

from colossal.kernels.optim._nvme_layout import BLOCK, StateLayout, padded


def _check(layout: StateLayout, sizes: dict[int, int]) -> None:
    """Every param's elements are covered once, in order; units are aligned, apart, bounded."""
    for key, numel in sizes.items():
        pieces = [p for _, p in layout.pieces(key)]
        assert pieces[0].start == 0 and pieces[-1].stop == numel
        assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert all(p.start % 16 == 0 for p in pieces)  # splits keep the kernel's vector groups
    end = 0
    for unit in layout.units:
        assert unit.offset == end and unit.offset % (4 * BLOCK) == 0
        assert 0 < unit.numel <= layout.capacity or not any(p.numel for p in unit.pieces)
        used = 0
        for piece in unit.pieces:  # pieces sit back to back, 64-byte aligned, no overlap
            assert piece.offset == used and piece.offset % 16 == 0
            used += padded(2 * piece.numel, 16)
        assert used == unit.numel
        end = unit.offset + unit.nbytes
    assert layout.file_nbytes == end


def test_small_params_share_a_unit_and_large_ones_are_split() -> None:
    layout = StateLayout(4096)
    sizes = {0: 10, 1: 700, 2: 5000, 3: 3, 4: 0, 5: 2048}
    for key, numel in sizes.items():
        layout.add(key, numel)
    _check(layout, sizes)
    assert [id(u) for u, _ in layout.pieces(0)] == [id(u) for u, _ in layout.pieces(1)]  # packed
    assert len(layout.pieces(2)) >= 3  # 10000 values over units of 4096
    assert max(u.numel for u in layout.units) <= 4096
    assert [id(u) for u in layout.units_of({3})] == [id(layout.pieces(3)[0][0])]


@pytest.mark.parametrize("capacity", [1024, 4096, 10_000])
def test_many_layouts_are_consistent(capacity: int) -> None:
    layout = StateLayout(capacity)
    sizes = {k: (k * 7919) % 6000 for k in range(40)}
    for key, numel in sizes.items():
        layout.add(key, numel)
    _check(layout, sizes)
    assert layout.capacity == padded(capacity)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="below one block"):
        StateLayout(BLOCK - 1)
    layout = StateLayout(BLOCK)
    layout.add(0, 5)
    with pytest.raises(ValueError, match="key 0 already"):
        layout.add(0, 5)
