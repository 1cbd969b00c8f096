"""Parameters shared by several stages (tied embeddings): sum their gradients after backward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed import ProcessGroup

from colossal.core.comm import all_reduce
from colossal.pipeline.stage_manager import PipelineStageManager


class SharedParamGradSync:
    """Sums, over the stages that hold a copy, the gradient of every shared parameter.

    Each entry of ``shared_params`` maps the pipeline stages holding a copy of one logical
    parameter to the local copy, e.g. ``{0: embed.weight, S - 1: lm_head.weight}``. Every rank
    passes the same entries with the same stage keys (the values for other stages are ignored
    and may be ``None``). Creating the sync creates one process group per entry, collectively,
    so every rank must construct it. Calling it all-reduces the local copy's gradient in that
    group, so all copies end with the same, summed gradient and stay tied after the step.

    Args:
        stage_manager: The stage manager.
        shared_params: One ``{stage: parameter}`` mapping per shared parameter.

    Raises:
        TypeError: An entry is not a mapping, or this stage's value is not a tensor.
        ValueError: A stage outside the pipeline.
    """

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        shared_params: Sequence[Mapping[int, torch.Tensor | None]],
    ) -> None:
        self._entries: list[tuple[torch.Tensor, ProcessGroup]] = []
        for i, mapping in enumerate(shared_params):
            if not isinstance(mapping, Mapping):
                raise TypeError(f"shared_params[{i}] must map stage -> parameter, got {mapping!r}")
            stages = sorted(mapping)
            if len(stages) < 2:
                continue
            group = stage_manager.init_process_group_by_stages(stages)
            if stage_manager.stage not in mapping:
                continue
            assert group is not None  # this rank's stage is among ``stages``

            param = mapping[stage_manager.stage]
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"shared_params[{i}][{stage_manager.stage}] must be this stage's parameter, "
                    f"got {type(param).__name__}"
                )
            self._entries.append((param, group))

    def __len__(self) -> int:
        return len(self._entries)

    def pairs(self) -> list[tuple[torch.Tensor, ProcessGroup]]:
        """This stage's shared parameters, each with the group of the stages holding it."""
        return list(self._entries)

    def __call__(self) -> None:
        """All-reduce (sum) every local shared parameter's gradient over its stages."""
        for param, group in self._entries:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            all_reduce(param.grad, group=group)
