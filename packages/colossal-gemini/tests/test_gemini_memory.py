"""Per-rank model-state memory: the ZeRO-3 formula, and optimizer offload of fp32 chunks.

``GeminiOptimizer.model_state_memory()`` reports the bytes by kind and location; with fp16/bf16
chunks, all sharded, between backward and step it must be the ZeRO-3 mixed-precision
``(2 + 2 + 12) * Psi / N`` bytes (low-precision parameter and gradient shards, fp32 master
and Adam's two moments) plus the chunks' padding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from colossal.core.testing import distributed_test
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.kernels import HybridAdam

V, H, SEQ = 32, 16, 4


class Mlp(nn.Module):
    """Embedding, two wide linears and a head: 3,088 parameters, little chunk padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(self.emb(ids))))))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).float()
    return nn.functional.cross_entropy(logits.reshape(-1, V), ((ids + 1) % V).reshape(-1))


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(10 * step + rank))


def _build(net: nn.Module, **kw: object) -> tuple[GeminiDDP, GeminiOptimizer]:
    optim = HybridAdam(net.parameters(), lr=1e-2)
    model = GeminiDDP(net, chunk_config_dict={"chunk_size": 1100}, **kw)  # type: ignore[arg-type]
    return model, GeminiOptimizer(optim, model, initial_scale=2**10)


@distributed_test(2)
def test_model_state_memory_is_the_zero3_formula(rank: int, world_size: int) -> None:
    """Exact bytes per kind and location, bf16 and fp16, optimizer side on device or host.

    Catches an fp32 gradient shard (18 instead of 16 bytes per element), optimizer states
    not counted or placed apart from their master, a gradient buffer or gathered payload
    kept after backward, and a report disagreeing with the budget's accounting.
    """
    torch.manual_seed(0)
    base = Mlp()
    psi = sum(p.numel() for p in base.parameters())
    for precision, offload in (("bf16", 0.0), ("fp16", 1.0)):
        model, opt = _build(copy.deepcopy(base), precision=precision, offload_optim_frac=offload)
        chunks = model.chunk_manager.chunks
        shard = sum(c.shard_size for c in chunks)  # elements of this rank's shards
        padding = sum(c.chunk_size - c.numel for c in chunks)
        assert padding * 40 <= psi  # the formula check below is meaningful (<2.5 % padding)
        for step in range(2):  # the second backward sees the optimizer states
            opt.backward(_loss(model, _ids(step, rank)))
            if step == 0:
                opt.step()
        mine = sum(v.numel for v in opt.master_views)
        report = opt.model_state_memory()
        opt_loc = "host" if offload else "device"
        want = {
            "param_shards": {"device": 2 * shard, "host": 0},
            "gathered_params": {"device": 0, "host": 0},
            "grad_buffers": {"device": 0, "host": 0},
            "grad_shards": {opt_loc: 2 * shard},
            "masters": {opt_loc: 4 * shard},
            "optimizer_states": {opt_loc: 8 * mine},
        }
        for kind, where in want.items():
            for loc, n in where.items():
                assert report[kind][loc] == n, (precision, kind, loc, report[kind], n)
        total = report["total"]["device"] + report["total"]["host"]
        assert total == 8 * shard + 8 * mine
        # Within 5 % of (2 + 2 + 12) * Psi / N on every rank (padding is the only excess).
        assert abs(total - 16 * psi / world_size) <= 0.05 * 16 * psi / world_size, total
        everyone = torch.tensor([total])
        torch.distributed.all_reduce(everyone)
        assert int(everyone) == 16 * psi + 8 * padding
        # The chunk kinds are exactly what the budget accounts.
        for loc in ("device", "host"):
            chunk_bytes = report["total"][loc] - report["optimizer_states"][loc]
            assert model.budget.used(loc) == chunk_bytes, (loc, model.budget)
        opt.step()
        assert opt.model_state_memory()["grad_shards"][opt_loc] == 0  # freed by the step


@distributed_test(2)
def test_offload_optim_with_fp32_chunks(rank: int, world_size: int) -> None:
    """offload_optim_frac offloads fp32 chunks too (they have no separate master).

    The optimizer side of an offloaded fp32 chunk is a host copy of its shard plus the
    gradient shard and the Adam states on the host; training is bit-equal to no offload.
    Catches the fraction being a no-op for fp32 (nothing on the host), and a host master
    copy that is not written back into the shard after the step (the next forward would
    use stale parameters, so the losses and parameters would differ).
    """
    torch.manual_seed(0)
    base = Mlp()
    results = []
    for frac in (0.0, 0.5, 1.0):
        model, opt = _build(copy.deepcopy(base), precision="fp32", offload_optim_frac=frac)
        chunks = model.chunk_manager.chunks
        host = [c for c in chunks if c.master_location == "host"]
        shard = sum(c.shard_bytes for c in chunks)
        offloaded = sum(c.shard_bytes for c in host)
        if frac == 0.0:
            assert not host and model.budget.used("host") == 0
        elif frac == 1.0:
            assert len(host) == len(chunks)
        else:
            assert 0 < len(host) < len(chunks)
        assert all(c.master is not None and c.master.dtype == torch.float32 for c in host)
        assert model.budget.used("device") == shard and model.budget.used("host") == offloaded
        losses = []
        for step in range(3):
            loss = _loss(model, _ids(step, rank))
            opt.backward(loss)
            if step == 0:  # gradient shards sit with the masters
                assert model.budget.used("host") == 2 * offloaded
                assert model.budget.used("device") == 2 * shard - offloaded
            opt.step()
            losses.append(loss.item())
        states = opt.model_state_memory()["optimizer_states"]
        assert (states["host"] > 0) == bool(host) and (states["device"] > 0) == (frac < 1)
        results.append((losses, model.state_dict()))
    for losses, state in results[1:]:
        assert losses == results[0][0]
        for name, t in state.items():
            assert torch.equal(t, results[0][1][name]), name
