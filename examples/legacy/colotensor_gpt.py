"""The seeds' "Parallelize Your Training like Megatron-LM via ColoTensor" tutorial, runnable.

A transformers GPT-2 (from a tiny config) is built inside ``ColoInitContext``; the page's
parameter loop splits ``wte``/``wpe``, ``attn.c_attn``/``attn.c_proj`` and ``mlp.c_fc`` along
their last dim and ``mlp.c_proj``'s weight along its first (GPT-2's ``Conv1D`` stores weights
``[in, out]``); every operator then runs on DTensor's sharding propagation. A plain loop with
torch's AdamW trains it; rank 0 prints each epoch's mean loss (``NUM_EPOCHS``, default 3, of
``--steps`` steps)::

    torchrun --nproc_per_node 2 examples/legacy/colotensor_gpt.py             # tp 2
    torchrun --nproc_per_node 4 examples/legacy/colotensor_gpt.py --tp 2      # tp 2 x dp 2
    python3 -m colossal.cli run --nproc_per_node 2 examples/legacy/colotensor_gpt.py

With dp > 1 each data-parallel rank takes its own batch and the gradients are averaged over dp.
Data: ``../shared/data/tinyshakespeare.txt`` (relative to the repository) when present, as
bytes folded into the vocabulary; otherwise random tokens (a message says so). ``--attn``
picks transformers' attention (``eager``, default, or ``sdpa``: colossal.legacy.tensor
registers a DTensor strategy for CPU flash attention). ``--dropout`` sets GPT-2's dropouts
(default 0): the modules' outputs are whole over tp where the page's compute specs say so, so
every tp rank draws the plain model's masks from torch's generator.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from colossalai.tensor import (
    ColoParameter,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ShardSpec,
)
from colossalai.utils.model.colo_init_context import ColoInitContext
from transformers import GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))
SHAKESPEARE = os.path.join(HERE, "..", "..", "..", "shared", "data", "tinyshakespeare.txt")


class GPTLMModel(nn.Module):
    """The page's model: a HuggingFace GPT-2 returning only the logits."""

    def __init__(
        self,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_attention_heads: int = 4,
        max_seq_len: int = 16,
        vocab_size: int = 64,
        dropout: float = 0.0,
        attn: str = "eager",
    ) -> None:
        super().__init__()
        config = GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_attention_heads,
            n_positions=max_seq_len,
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
        config._attn_implementation = attn
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


class GPTLMLoss(nn.Module):
    """The page's loss: next-token cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def split_param_single_dim_tp1d(dim: int, param: ColoParameter, pg: ProcessGroup) -> None:
    """The page's helper: shard ``param`` along ``dim`` over the tp ranks."""
    spec = (ShardSpec([dim], [pg.tp_world_size()]), ComputeSpec(ComputePattern.TP1D))
    if param.process_group.tp_world_size() == 1:
        param.set_process_group(pg)
    param.set_tensor_spec(*spec)


def split_param_row_tp1d(param: ColoParameter, pg: ProcessGroup) -> None:
    split_param_single_dim_tp1d(0, param, pg)


def split_param_col_tp1d(param: ColoParameter, pg: ProcessGroup) -> None:
    split_param_single_dim_tp1d(-1, param, pg)


def tensor_parallelize(model: nn.Module, pg: ProcessGroup) -> None:
    """The page's parameter loop."""
    for mn, module in model.named_modules():
        for pn, param in module.named_parameters(recurse=False):
            param.set_process_group(pg)  # set process group for all parameters
            if "mlp.c_fc" in mn:
                if "weight" in pn or "bias" in pn:
                    split_param_col_tp1d(param, pg)  # column slice
                    param.compute_spec.set_output_replicate(False)  # keep c_fc's output split
            elif "mlp.c_proj" in mn:
                if "weight" in pn:
                    split_param_row_tp1d(param, pg)  # row slice
            elif "wte" in mn or "wpe" in mn:
                split_param_col_tp1d(param, pg)  # column slice
            elif "c_attn" in mn or "c_proj" in mn:
                split_param_col_tp1d(param, pg)  # column slice


def batches(args: argparse.Namespace, pg: ProcessGroup) -> list[torch.Tensor]:
    """``epochs * steps`` batches of ``args.batch`` sequences: this dp rank's."""
    gen = torch.Generator().manual_seed(1234 + pg.dp_local_rank())
    if os.path.exists(SHAKESPEARE):
        with open(SHAKESPEARE, "rb") as f:
            data = torch.tensor(list(f.read()), dtype=torch.long) % args.vocab
    else:
        if dist.get_rank() == 0:
            print(f"{SHAKESPEARE} not found: training on random tokens")
        data = torch.randint(0, args.vocab, (100_000,), generator=gen)
    out = []
    for _ in range(args.epochs * args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        out.append(torch.stack([data[s : s + args.seq] for s in starts.tolist()]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None, help="tensor parallel degree (default: world)")
    p.add_argument("--epochs", type=int, default=int(os.environ.get("NUM_EPOCHS", "3")))
    p.add_argument("--steps", type=int, default=3, help="steps per epoch")
    p.add_argument("--batch", type=int, default=4, help="sequences per dp rank")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dropout", type=float, default=0.0, help="GPT-2's dropout probabilities")
    p.add_argument("--attn", choices=["eager", "sdpa"], default="eager", help="attention")
    args = p.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    tp = args.tp or world
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
    pg = ProcessGroup(tp_degree=tp, dp_degree=world // tp)

    torch.manual_seed(0)
    with ColoInitContext(device=torch.device("cpu")):
        model = GPTLMModel(
            max_seq_len=args.seq, vocab_size=args.vocab, dropout=args.dropout, attn=args.attn
        )
    tensor_parallelize(model, pg)
    criterion = GPTLMLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(args, pg)
    for epoch in range(args.epochs):
        total = 0.0
        for ids in data[epoch * args.steps : (epoch + 1) * args.steps]:
            logits = model(ids, torch.ones_like(ids))
            loss = criterion(logits, ids)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        if dist.get_rank() == 0:
            mean = total / args.steps
            print(f"Epoch {epoch} - train loss: {mean:.5f} (tp {tp}, dp {world // tp})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
