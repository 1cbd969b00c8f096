"""RuntimeMemTracer / MemStats: non-model bytes against hand-computed activations, use order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.gemini import MemStats, RuntimeMemTracer, StepRecord

B, D_IN, H, D_OUT, E = 4, 16, 32, 8, 4  # batch, widths, fp32 element size


def test_mlp_non_model_bytes_equal_hand_computed_activations() -> None:
    # Linear(D_IN,H) -> ReLU -> Linear(H,D_OUT), fp32, loss = out.sum(). By hand (bytes):
    #   x = B*D_IN*E, h1 = h2 = B*H*E (Linear0 and ReLU outputs), out = B*D_OUT*E,
    #   loss = seed = E (the scalar loss and backward's ones_like seed).
    # Forward: addmm saves x and weight.t() (a view of the parameter: model data, not
    # counted), ReLU saves its output h2, h1 dies when ReLU returns.
    #   forward peak (ReLU step) = x + h1 + h2
    # Backward: Linear2 makes grad_h2 (B*H), grad_W2 (D_OUT*H), grad_b2 (D_OUT); the two
    # parameter grads become model data once accumulated. ReLU makes grad_h1, frees h2 and
    # grad_h2. Linear0 (x needs no grad) makes grad_W1 (H*D_IN) and grad_b1 (H).
    #   Linear0 backward peak = x + loss + seed + grad_h1 + grad_W1 + grad_b1  (the maximum)
    #   after the trace: x + loss (grads are model data, temporaries and the seed freed).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))
    x = torch.randn(B, D_IN)
    tracer = RuntimeMemTracer(model)
    with pytest.raises(RuntimeError, match="no trace"):
        _ = tracer.memstats
    with tracer:
        out = tracer(x)
        loss = out.sum()
        del out
        tracer.backward(loss)
    stats = tracer.memstats

    x_b, act, out_b, scalar = B * D_IN * E, B * H * E, B * D_OUT * E, E
    labels = [(r.phase, r.label) for r in stats.steps]
    assert labels == [
        ("forward", "0"), ("forward", "1"), ("forward", "2"),
        ("backward", "<start>"), ("backward", "2"), ("backward", "1"), ("backward", "0"),
    ]
    fwd = [r for r in stats.steps if r.phase == "forward"]
    # Catches: parameters (or the weight.t() views) counted as activations, freed storages
    # (h1) never subtracted, an activation counted twice.
    assert fwd[0].peak_bytes == x_b + act
    assert fwd[1].peak_bytes == x_b + 2 * act
    assert fwd[1].end_bytes == x_b + act
    assert fwd[2].peak_bytes == x_b + act + out_b + scalar
    # Catches: gradients of parameters kept as non-model data after accumulation, backward
    # temporaries missed (ops run by the autograd engine not seen), views double counted.
    peak = x_b + 2 * scalar + act + H * D_IN * E + H * E
    assert stats.peak_non_model_bytes == peak
    assert stats.non_model_bytes(len(stats) - 1) == peak
    assert stats.steps[4].peak_bytes == x_b + 2 * scalar + act + act + D_OUT * H * E + D_OUT * E
    assert stats.steps[-1].end_bytes == x_b + scalar
    # The tracer leaves no hooks behind and changes nothing.
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert model[0].weight.grad is not None
    with pytest.raises(IndexError, match="step 7"):
        stats.non_model_bytes(7)


class _Net(nn.Module):
    """Modules defined in a different order from their use; `mid.weight` reused (tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3)
        self.mid = nn.Linear(8, 8)
        self.emb = nn.Linear(4, 8)
        self.emb.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.emb(x)).relu()
        # second use of the tied weight, outside any module
        h = torch.nn.functional.linear(h, self.mid.weight)
        return self.head(h)


def test_parameter_use_order_follows_forward_and_next_use() -> None:
    torch.manual_seed(0)
    net = _Net()
    with RuntimeMemTracer(net) as tracer:
        net(torch.randn(2, 4)).square().mean().backward()
    stats = tracer.memstats
    emb, mid, head = net.emb, net.mid, net.head
    # Catches: definition order (head first) reported instead of use order, a view of a
    # parameter (weight.t()) not recognised as a use, bias/weight missed.
    order = [emb.weight, emb.bias, mid.weight, mid.bias, head.weight, head.bias]
    assert [id(p) for p in stats.first_use_order("forward")] == [id(p) for p in order]
    back = stats.first_use_order("backward")
    # Catches: backward order not reversed; a frozen layer reported as used in backward
    # (x needs no grad, so emb's backward reads nothing).
    key = [p for p in back if p is head.weight or p is mid.weight]
    assert key[0] is head.weight and key[1] is mid.weight and len(key) == 2
    assert all(p is not emb.weight and p is not emb.bias for p in back)
    steps = {(r.phase, r.label): r.index for r in stats.steps}
    f_emb, f_mid, f_head = steps["forward", "emb"], steps["forward", "mid"], steps[
        "forward", "head"]
    b_head, b_mid = steps["backward", "head"], steps["backward", "mid"]
    assert f_emb < f_mid < f_head < b_head < b_mid
    # Catches: next_use off by one (the current step counts), never-used-again not None,
    # a second use (the tied F.linear, in mid's step; backward) lost.
    assert stats.next_use(head.weight, 0) == f_head
    assert stats.next_use(head.weight, f_head) == f_head
    assert stats.next_use(head.weight, f_head + 1) == b_head
    assert stats.next_use(emb.weight, f_emb + 1) is None
    assert stats.next_use(mid.weight, f_mid + 1) in range(f_head + 1, b_mid + 1)
    assert b_mid in stats.use_steps(mid.weight)
    assert stats.use_steps(nn.Parameter(torch.zeros(1))) == ()
    # remap to chunk ids: the next-use table the auto policy consumes.
    chunk_of = {id(emb.weight): "c0", id(emb.bias): "c0", id(mid.weight): "c1",
                id(mid.bias): "c1", id(head.weight): "c2", id(head.bias): "c2"}
    by_chunk = stats.remap(lambda p: chunk_of[id(p)])
    assert by_chunk.first_use_order("forward") == ["c0", "c1", "c2"]
    assert by_chunk.next_use("c2", f_head + 1) == b_head
    assert by_chunk.peak_non_model_bytes == stats.peak_non_model_bytes
    assert all(len(set(r.uses)) == len(r.uses) for r in by_chunk.steps)


def test_memstats_validates_indices() -> None:
    rec = StepRecord(1, "forward", "x", 0, 0, 0)
    with pytest.raises(ValueError, match="index 1"):
        MemStats([rec])
    assert MemStats().peak_non_model_bytes == 0
