"""GeminiDDP(extra_dp_group=...): chunks sharded over a zero group, replicated across another.

Four ranks as ``ParallelDims(dp=4, dp_shard=2)``: the chunks are sharded over the zero group
(``dp_shard``, 2 ranks) and the ranks of the extra-dp group (``dp_replicate``) hold replicas
of the same shards. Each rank trains on its quarter of the global batch; the result must
equal one fp32 process running AdamW on the whole batch (``TOL`` relative, per tensor: the
gradients are summed in two stages, zero then extra dp). Checked too: each shard is half of
its chunk, replicas hold identical gradient shards after backward, the gradient norm equals
the reference's (counted once per shard, not once per replica), and two backwards
accumulating into the shards (averaged over the replicas once, when the optimizer reads
them) equal one backward of the whole batch.

What a wrong composition gives: gradients not averaged over the replicas (each replica
steps on its half of the batch), averaged twice (half the step), or a norm summed over the
replicas too (sqrt(2) times the reference's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import ParallelDims
from colossal.core.comm import all_gather_object
from colossal.core.testing import distributed_test, relative_error
from colossal.gemini import GeminiDDP, GeminiOptimizer

BATCH, IN, OUT = 8, 6, 4
STEPS = 3
LR = 1e-2
TOL = 5e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 12), nn.Tanh(), nn.Linear(12, OUT))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _reference() -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
    return model, norms


def _build(dims: ParallelDims, accumulate: bool = False) -> tuple[GeminiDDP, GeminiOptimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ddp = GeminiDDP(model, process_group=dims.group("dp_shard"),
                    extra_dp_group=dims.group("dp_replicate"), precision="fp32",
                    chunk_config_dict={"chunk_size": 32},
                    enable_gradient_accumulation=accumulate)  # fmt: skip
    # max_norm far above the norms: the norm is measured, nothing is clipped
    return ddp, GeminiOptimizer(opt, ddp, max_norm=1e9)


@distributed_test(4)
def test_extra_dp_equals_one_process(rank: int, world_size: int) -> None:
    dims = ParallelDims(dp=4, dp_shard=2)
    ref, ref_norms = _reference()
    expected = dict(ref.named_parameters())
    n = BATCH // world_size
    for accumulate in (False, True):
        ddp, opt = _build(dims, accumulate)
        manager = ddp.chunk_manager
        assert manager.extra_dp_size == 2 and len(manager.chunks) > 1
        for chunk in manager.chunks:
            assert chunk.world_size == 2 and chunk.shard_size * 2 == chunk.chunk_size
        for step in range(STEPS):
            x, y = _batch(step)
            x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
            if accumulate:
                for half in (slice(0, n // 2), slice(n // 2, n)):
                    opt.backward(nn.functional.mse_loss(ddp(x[half]), y[half]) / 2)
            else:
                opt.backward(nn.functional.mse_loss(ddp(x), y))
                shards = [c.grad_shard.clone() for c in manager.chunks]
                theirs = all_gather_object(shards, ddp.extra_dp_group)
                assert all(torch.equal(a, b) for a, b in zip(*theirs, strict=True))
            opt.step()
            norm = opt.get_grad_norm()
            assert abs(norm - ref_norms[step]) <= TOL * ref_norms[step], (norm, ref_norms)
            opt.zero_grad()
        state = ddp.state_dict()
        for name, want in expected.items():
            err = relative_error(state[name], want.detach())
            assert err <= TOL, f"accumulate={accumulate}: {name} off by {err:.2e}"
    dist.barrier()
