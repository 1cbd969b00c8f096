"""LayerEnv: the state the mode-dispatched layers pass from one layer to the next.

ColossalAI's ``colossalai.nn`` layers read and toggled a global environment while a model
was built: in ``'1d'``, whether the next layer's input is split (``parallel_input``: a
column-parallel Linear sets it, a row-parallel one clears it, so consecutive
``col_nn.Linear`` layers alternate column, row, column...); in ``'3d'``, which cube axis
plays the input and which the output (each Linear exchanges them). Here that state lives on
the context (``gpc.layer_env``), reset with it: at launch and by ``gpc.destroy()``. Build
the layers in the order the forward runs them, as with ColossalAI.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerEnv"]


@dataclass
class LayerEnv:
    """What the next mode-dispatched layer's input looks like.

    Attributes:
        parallel_input: ``'1d'``: the input's last dim is split over the tensor group (the
            previous layer was a column-parallel Linear).
        swapped_3d: ``'3d'``: the input is in the swapped orientation (input and output
            axes exchanged by an odd number of Linear layers before it).
    """

    parallel_input: bool = False
    swapped_3d: bool = False

    def reset(self) -> None:
        """Back to a model's first layer: whole input, unswapped."""
        self.parallel_input = False
        self.swapped_3d = False
