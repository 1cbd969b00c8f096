"""``assert_equal_in_group``: every rank of a group holds the same tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from colossal.core.comm import all_gather

__all__ = ["assert_equal_in_group"]


def assert_equal_in_group(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> None:
    """Fail on every rank unless all ranks of ``process_group`` hold an equal ``tensor``.

    Collective: every rank of the group must call it with a tensor of the same shape and dtype.

    Raises:
        AssertionError: Names the first pair of neighbouring ranks (group ranks) that differ.
    """
    world = dist.get_world_size(process_group)
    flat = tensor.detach().contiguous().reshape(-1)
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    all_gather(gathered, flat, group=process_group)
    parts = gathered.view(world, -1)
    for i in range(world - 1):
        if not torch.equal(parts[i], parts[i + 1]):
            raise AssertionError(
                f"expected the tensors of group ranks {i} and {i + 1} to be equal, but they "
                f"differ: {parts[i].view_as(tensor)} vs {parts[i + 1].view_as(tensor)}"
            )
