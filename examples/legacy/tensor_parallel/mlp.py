"""The seeds' 1D / 2D / 2.5D / 3D tensor parallelism pages: an MLP of ``colossalai.nn`` layers.

Run (from the repository root):
``python3 -m colossal.cli run --nproc_per_node 4 examples/legacy/tensor_parallel/mlp.py
--config examples/legacy/tensor_parallel/configs/tp_2d.py`` (``tp_1d.py``: 2 processes;
``tp_2p5d.py`` and ``tp_3d.py``: 8).

As on the pages, with ``launch_from_torch`` and gloo instead of ``launch(rank=..., ...)``
on GPUs. The weights are printed in ColossalAI's ``[in, out]`` layout, as the pages print
them: ``weight.transpose(0, 1).shape`` (Colossal keeps torch's ``[out, in]``, so the 2D/2.5D/3D
pages' ``weight.shape`` reads ``transpose(0, 1)`` here, as the 1D page already does).
"""

import colossalai
import colossalai.nn as col_nn
import torch
from colossalai.context import ParallelMode
from colossalai.core import global_context as gpc
from colossalai.utils import get_current_device, print_rank_0


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 256):
        super().__init__()
        intermediate_dim = dim * 4
        self.dense_1 = col_nn.Linear(dim, intermediate_dim)
        print_rank_0(
            f"Weight of the first linear layer: {self.dense_1.weight.transpose(0, 1).shape}"
        )
        self.activation = torch.nn.GELU()
        self.dense_2 = col_nn.Linear(intermediate_dim, dim)
        print_rank_0(
            f"Weight of the second linear layer: {self.dense_2.weight.transpose(0, 1).shape}"
        )
        self.dropout = col_nn.Dropout(0.1)

    def forward(self, x):
        x = self.dense_1(x)
        print_rank_0(f"Output of the first linear layer: {x.shape}")
        x = self.activation(x)
        x = self.dense_2(x)
        print_rank_0(f"Output of the second linear layer: {x.shape}")
        x = self.dropout(x)
        return x


def partition(x):
    """The page's "partition input" lines for the config's mode (1D: the whole input)."""
    mode = gpc.config.parallel.tensor.mode
    if mode == "2d":
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_COL)]
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_ROW)]
    elif mode == "2.5d":
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_DEP)]
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_COL)]
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_2P5D_ROW)]
    elif mode == "3d":
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_WEIGHT)]
        x = torch.chunk(x, 2, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_INPUT)]
        x = torch.chunk(x, 2, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_3D_OUTPUT)]
    return x


def main():
    parser = colossalai.get_default_parser()
    args = parser.parse_args()
    torch.set_num_threads(1)
    colossalai.launch_from_torch(config=args.config, backend="gloo")

    m = MLP()

    x = torch.randn((16, 256), device=get_current_device())
    # partition input
    torch.distributed.broadcast(x, src=0)
    x = partition(x)
    print_rank_0(f"Input: {x.shape}")

    x = m(x)
    gpc.destroy()


if __name__ == "__main__":
    main()
