"""A plain torchrun + DDP training script: a small character-level language model.

python3 -m torch.distributed.run --nproc_per_node 2 train_ddp.py --steps 200
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from colossal.core import destroy

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE = os.path.join(HERE, "..", "..", "..", "shared", "data", "tinyshakespeare.txt")


def load_text() -> str:
    """Tiny Shakespeare when it is there, else the text files of this repository."""
    if os.path.exists(SHAKESPEARE):
        with open(SHAKESPEARE, encoding="utf-8") as fh:
            return fh.read()
    files = sorted(glob.glob(os.path.join(HERE, "..", "..", "**", "*.md"), recursive=True))
    return "\n".join(open(f, encoding="utf-8").read() for f in files)


class CharModel(nn.Module):
    """Embeds a window of characters and predicts the next one."""

    def __init__(self, vocab: int, context: int = 16, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.mlp = nn.Sequential(nn.Linear(32 * context, width), nn.GELU(), nn.Linear(width, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[:200_000]])
    context = 16

    torch.manual_seed(0)
    model = CharModel(len(chars), context)
    model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - context - 1, (args.batch_size,), generator=gen)
        x = torch.stack([data[s : s + context] for s in starts])
        y = data[starts + context]
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.3f}")
    if rank == 0:
        print(f"final loss {loss.item():.3f} on {world} ranks")
    # destroy_process_group(), keeping the gloo groups' native objects to the process's end:
    # freeing one while a gloo worker thread finishes a collective can hang or abort the exit.
    destroy()


if __name__ == "__main__":
    main()
