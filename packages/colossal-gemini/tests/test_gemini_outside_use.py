"""GeminiDDP with managed parameters used outside the forward of the module that owns them.

A nanoGPT-style tied head in the root forward (``F.linear(h, self.emb.weight)`` or
``h @ self.emb.weight.t()``) and a weight used both through its module and directly: the
module hooks alone never gather for such a use (the parameter is a released, empty tensor:
"size mismatch ... vec (0)"). Each variant trains 5 AdamW steps against a single-process fp32
reference, and the collectives per step are counted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional

from colossal.core import CommTracker
from colossal.core.testing import distributed_test
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.kernels import HybridAdam

V, H, T, GLOBAL_BATCH, STEPS = 16, 8, 4, 8, 5
CHUNK = {"chunk_size": 64}
HEADS = ("linear", "matmul", "both")
AGAIN = {"linear": 1, "matmul": 1, "both": 3}  # forward re-gathers (see the test)


class OutsideGPT(nn.Module):
    """Embeddings, an MLP block, a LayerNorm and a head reading ``emb.weight`` directly.

    ``head``: ``"linear"`` (``F.linear(h, emb.weight)``), ``"matmul"`` (``h @ emb.weight.t()``)
    or ``"both"`` (the matmul head, plus ``mix.weight`` used directly before and after a call
    of ``mix`` itself).
    """

    def __init__(self, head: str) -> None:
        super().__init__()
        self.head = head
        self.emb = nn.Embedding(V, H)
        self.pos = nn.Embedding(T, H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        self.mix = nn.Linear(H, H) if head == "both" else None
        self.norm = nn.LayerNorm(H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        if self.mix is not None:
            h = torch.tanh(functional.linear(h, self.mix.weight))  # before its module runs
            h = self.mix(h)
            h = h + torch.tanh(h @ self.mix.weight.t())  # after it
        h = self.norm(h)
        if self.head == "linear":
            return functional.linear(h, self.emb.weight)
        return h @ self.emb.weight.t()


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).float()
    return functional.cross_entropy(logits.reshape(-1, V), ((ids * 3 + 1) % V).reshape(-1))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, (GLOBAL_BATCH, T), generator=g) for _ in range(STEPS)]


def _reference(model: nn.Module, data: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses = []
    for ids in data:
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# Tolerances after 5 AdamW steps (lr 0.02) against the fp32 run, as in
# test_gemini_optimizer_e2e: fp32 1e-5 (losses and parameters); bf16 rounds gradients by
# ~1e-2 relative and Adam moves a near-zero-gradient element by ~lr either way: losses 5e-3
# relative, parameters mean 5e-3 and max 0.1 (= 5 * lr).
CASES = (("fp32", 1e-5, 1e-5, 1e-5), ("bf16", 5e-3, 5e-3, 0.1))


@distributed_test(2)
def test_outside_use_trains_like_adamw(rank: int, world_size: int) -> None:
    """Tied heads outside any module call and a weight used in and out of its module.

    Catches: the outside use not gathered (a size-mismatch error on the empty parameter);
    a view (``.t()``) of a payload read after its chunk was released (wrong logits or an
    error); the outside call missing from the backward walk (its backward on a released
    chunk, or the tied gradient missing the head's part); a chunk gathered twice in
    backward or never released (the counts); ranks issuing different collectives (a hang
    turned into the collective timeout's error).
    """
    data = _data()
    n = GLOBAL_BATCH // world_size
    for head in HEADS:
        torch.manual_seed(0)
        ref = OutsideGPT(head)
        ref_trained = copy.deepcopy(ref)
        want = _reference(ref_trained, data)
        for precision, loss_tol, mean_tol, max_tol in CASES:
            net = copy.deepcopy(ref)
            model = GeminiDDP(net, precision=precision, chunk_config_dict=CHUNK)
            opt = GeminiOptimizer(HybridAdam(net.parameters(), lr=0.02, weight_decay=0.1),
                                  model, initial_scale=2**12)
            chunks = model.chunk_manager.chunks
            emb = model.chunk_manager.chunk_of(net.emb.weight)
            assert len(chunks) >= 3 and not emb.keep_gathered
            losses = []
            for step, ids in enumerate(data):
                local = ids[rank * n : (rank + 1) * n]
                with CommTracker() as tracker:
                    out = model(local)
                    fwd = tracker.calls("all_gather")
                    loss = functional.cross_entropy(out.float().reshape(-1, V),
                                                    ((local * 3 + 1) % V).reshape(-1))
                    opt.backward(loss)
                what = f"{head} {precision} step {step}"
                # Forward: every chunk once, plus one gather per use after its chunk was
                # released (the head: emb's chunk again; "both": mix.weight's chunk is
                # released after each of its three uses); backward: every chunk once.
                assert fwd == len(chunks) + AGAIN[head], (what, fwd, chunks)
                assert tracker.calls("all_gather") == 2 * len(chunks) + AGAIN[head], what
                assert tracker.calls("reduce_scatter") == len(chunks), what
                assert not any(c.is_gathered for c in chunks), f"{what}: released"
                opt.step()
                t = loss.detach().clone()
                torch.distributed.all_reduce(t)
                losses.append(t.item() / world_size)
            assert losses == pytest.approx(want, rel=loss_tol, abs=loss_tol), (head, precision)
            full = model.state_dict()
            for name, p in ref_trained.named_parameters():
                diff = (full[name] - p.detach()).abs()
                assert diff.mean() <= mean_tol and diff.max() <= max_tol, (
                    f"{head} {precision} {name}: mean {diff.mean():.2e}, max {diff.max():.2e}")

            # An evaluation forward (no autograd) still gathers for the outside use, records
            # nothing for backward and releases everything at its end.
            if precision == "fp32":
                ids = data[0][rank * n : (rank + 1) * n]
                with torch.no_grad():
                    got = model(ids)
                    expected = ref_trained(ids)
                # The parameters differ by up to 1e-5 (above); the logits by a few times that.
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
                assert not any(c.is_gathered for c in chunks), f"{head}: eval released"


def test_world1_gradients_and_metadata() -> None:
    """One process: gradients equal the plain model's; metadata reads gather nothing.

    Catches the head's contribution to the tied gradient lost, and ``dtype``/``device``/
    ``requires_grad`` reads of a released parameter gathering its chunk (and pinning it).
    """
    torch.manual_seed(0)
    net = OutsideGPT("both")
    ref = copy.deepcopy(net)
    ids = _data()[0]
    model = GeminiDDP(net, precision="fp32", chunk_config_dict=CHUNK)
    model.backward(_loss(model, ids))
    _loss(ref, ids).backward()
    for name, p, chunk in model.trainable_shards():
        start, stop, got = chunk.tensor_shard(p, source="grad")
        want = dict(ref.named_parameters())[name].grad.reshape(-1)[start:stop]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert not any(c.is_gathered for c in model.chunk_manager.chunks)

    class Meta(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(H, H)
            self.b = nn.Linear(H, H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = self.b.weight
            assert w.dtype == torch.float32 and w.requires_grad and w.device == x.device
            return self.a(x)

    model = GeminiDDP(Meta(), precision="fp32", chunk_config_dict={"chunk_size": 72})
    b = model.chunk_manager.chunk_of(model.module.b.weight)
    assert b is not model.chunk_manager.chunk_of(model.module.a.weight)
    accessed: list[int] = []
    access = model.chunk_manager.access
    model.chunk_manager.access = lambda c: (accessed.append(c.chunk_id), access(c))[1]
    model(torch.randn(2, H))
    assert accessed and b.chunk_id not in accessed, accessed
