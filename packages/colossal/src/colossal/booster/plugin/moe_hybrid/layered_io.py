"""Checkpoint IO of MoeHybridParallelPlugin under tensor or pipeline parallelism.

Model checkpoints work as under ep x dp (each stage's tensors from its ranks, tensor-parallel
parts joined, experts gathered over ep). Optimizer checkpoints are not supported there yet:
:class:`MoeCheckpointIO` gathers both ZeRO parts' states over ep and moe_dp only, and under
tp or pp its gathers would wait on ranks that hold other parts (a hang), so they are refused
before any communication.
"""

from __future__ import annotations

from colossal.booster.plugin.moe_hybrid.checkpoint_io import MoeCheckpointIO
from colossal.core import OptimizerWrapper

__all__ = ["MoeLayeredCheckpointIO"]


class MoeLayeredCheckpointIO(MoeCheckpointIO):
    """:class:`MoeCheckpointIO` for ``tp_size > 1`` or ``pp_size > 1`` (no optimizer files).

    Args:
        dense_writer: Whether this rank is dp rank 0 (it offers the dense tensors).
        expert_writer: Whether this rank is moe_dp rank 0 (it offers its experts' blocks).
        layout: ``(tp_size, pp_size)``, named in the refusal.
    """

    def __init__(self, dense_writer: bool, expert_writer: bool, layout: tuple[int, int]) -> None:
        super().__init__(dense_writer, expert_writer)
        self.moe_layout = layout

    def _refuse(self) -> NotImplementedError:
        tp, pp = self.moe_layout
        return NotImplementedError(
            f"MoeHybridParallelPlugin(tp_size={tp}, pp_size={pp}) does not save or load "
            "optimizer checkpoints yet (only with tp_size=1 and pp_size=1); save the model "
            "(booster.save_model), or torch.save(optimizer.state_dict()) on every rank"
        )

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Not supported under tensor or pipeline parallelism.

        Raises:
            NotImplementedError: always (before any communication).
        """
        raise self._refuse()

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        """Not supported under tensor or pipeline parallelism.

        Raises:
            NotImplementedError: always (before any communication).
        """
        raise self._refuse()
