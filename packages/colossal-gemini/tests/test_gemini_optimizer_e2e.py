"""GeminiDDP + GeminiOptimizer end to end against a single-process torch AdamW run.

Each rank trains on its equal slice of the global batch; the reference trains an fp32 copy
of the model on the whole global batch in one process (its mean loss has the same gradient
as the average of the slices' mean losses).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from colossal.core.testing import distributed_test
from colossal.gemini import GeminiDDP, GeminiOptimizer
from colossal.kernels import HybridAdam

V, H, GLOBAL_BATCH, SEQ, STEPS = 16, 8, 8, 3, 5
CHUNK = {"chunk_size": 64}


class Tiny(nn.Module):
    """Embedding, a LayerNorm'd MLP block and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        return self.head(self.norm(h))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).float()
    return nn.functional.cross_entropy(logits.reshape(-1, V), ((ids * 3 + 1) % V).reshape(-1))


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _reference(model: nn.Module, data: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(_groups(model), lr=0.02)
    losses = []
    for ids in data:
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(model: GeminiDDP, opt: GeminiOptimizer, data: list[torch.Tensor], rank: int,
           world: int) -> list[float]:
    n = GLOBAL_BATCH // world
    losses = []
    for ids in data:
        loss = _loss(model, ids[rank * n : (rank + 1) * n])
        opt.backward(loss)
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _check_params(model: GeminiDDP, ref: nn.Module, mean_tol: float, max_tol: float,
                  what: str = "") -> None:
    """Mean and max absolute difference of every parameter from the reference."""
    full = model.state_dict()
    for name, p in ref.named_parameters():  # tied weights once
        diff = (full[name].float() - p.detach().float()).abs()
        assert diff.mean() <= mean_tol and diff.max() <= max_tol, (
            f"{name} {what}: mean {diff.mean():.2e} (<= {mean_tol}), max {diff.max():.2e} "
            f"(<= {max_tol})")


# Tolerances after 5 AdamW steps (lr 0.02) against the fp32 run. fp32: 1e-5. fp16/bf16:
# gradients carry ~1e-3 / ~1e-2 relative rounding, and Adam's first steps move an element by
# about lr * sign(grad) whatever its size, so an element whose gradient is near 0 can move
# the other way: the mean difference is bounded tightly (fp16 1e-3, bf16 5e-3) and the
# largest one by a few such flips (fp16 1e-2, bf16 0.1 = 5 * lr). Losses: fp16 1e-3 and
# bf16 5e-3 relative.
CASES = (("fp32", 1e-5, 1e-6, 1e-5), ("fp16", 1e-3, 1e-3, 1e-2), ("bf16", 5e-3, 5e-3, 0.1))


@distributed_test(1, 2, 4)
def test_matches_single_process_adamw(rank: int, world_size: int) -> None:
    """Losses and parameters after 5 steps, fp32/fp16/bf16, half the chunks kept gathered and
    half the optimizer states on the host, two param groups, a tied head.

    Catches any piece of the chain going wrong at some world size: the hooks' reductions,
    masters split over ranks (world 4 splits most parameters), the groups' weight decay,
    the fused loss-scale divisor, the shard refresh after the step, tied weights stepped
    twice.
    """
    data = _data()
    ref = Tiny()
    ref_trained = copy.deepcopy(ref)
    want = _reference(ref_trained, data)
    for precision, loss_tol, mean_tol, max_tol in CASES:
        net = copy.deepcopy(ref)
        hybrid = HybridAdam(_groups(net), lr=0.02)  # built on the model, as users do
        model = GeminiDDP(net, precision=precision, chunk_config_dict=CHUNK,
                          shard_param_frac=0.5, offload_optim_frac=0.5)
        opt = GeminiOptimizer(hybrid, model, initial_scale=2**12)
        if precision != "fp32":  # fp32 chunks have no separate master to place
            locations = {c.master_location for c in model.chunk_manager.chunks}
            assert locations == {"device", "host"}
        losses = _train(model, opt, data, rank, world_size)
        assert losses == pytest.approx(want, rel=loss_tol, abs=loss_tol), precision
        _check_params(model, ref_trained, mean_tol, max_tol, precision)


@distributed_test(2)
def test_lora_trains_only_adapters(rank: int, world_size: int) -> None:
    """A peft LoRA model: adapters train like the reference, base weights stay and hold no
    optimizer state.

    Catches frozen base weights entering the optimizer (state for them, or weight decay
    moving them), and adapters not trained through Gemini.
    """
    peft = pytest.importorskip("peft")

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, H)
            self.proj = nn.Linear(H, H)
            self.out = nn.Linear(H, V)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(torch.tanh(self.proj(self.emb(ids))))

    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["proj", "out"],
                             init_lora_weights=False)
    ref = peft.get_peft_model(Base(), config)
    base_names = {n for n, p in ref.named_parameters() if not p.requires_grad}
    adapter_names = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert adapter_names and all("lora_" in n for n in adapter_names)
    data = _data()
    ref_trained = copy.deepcopy(ref)
    want = _reference(ref_trained, data)
    net = copy.deepcopy(ref)
    hybrid = HybridAdam(_groups(net), lr=0.02)
    model = GeminiDDP(net, precision="fp32", chunk_config_dict=CHUNK)
    opt = GeminiOptimizer(hybrid, model)
    held = {v.name for v in opt.master_views}
    assert held and held <= adapter_names
    assert len(opt.state) == 0
    losses = _train(model, opt, data, rank, world_size)
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert {v.name for v in opt.master_views if opt.state[v.view]} == held
    assert len(opt.state) == len(held)  # no state for any base weight
    _check_params(model, ref_trained, 1e-6, 1e-5)
    full = model.state_dict()
    for name, p in ref.named_parameters():
        if name in base_names:  # untouched by training
            assert torch.equal(full[name], p.detach()), name


@distributed_test(2)
def test_gradient_accumulation_equals_the_large_batch(rank: int, world_size: int) -> None:
    """Two micro-batches per step (``enable_gradient_accumulation``) == the whole batch.

    Catches an optimizer step that sees only the last micro-batch's gradients (a reduction
    replacing the gradient shards), or a loss scale applied to each micro-batch but
    unscaled once per micro-batch.
    """
    data = _data()
    ref = Tiny()
    ref_trained = copy.deepcopy(ref)
    _reference(ref_trained, data)
    for precision, mean_tol, max_tol in (("fp32", 1e-6, 1e-5), ("fp16", 1e-3, 1e-2)):
        net = copy.deepcopy(ref)
        hybrid = HybridAdam(_groups(net), lr=0.02)
        model = GeminiDDP(net, precision=precision, chunk_config_dict=CHUNK,
                          enable_gradient_accumulation=True)
        opt = GeminiOptimizer(hybrid, model, initial_scale=2**12)
        n = GLOBAL_BATCH // world_size
        for ids in data:
            local = ids[rank * n : (rank + 1) * n]
            with model.no_sync():
                opt.backward(_loss(model, local[: n // 2]) / 2)
            opt.backward(_loss(model, local[n // 2 :]) / 2)
            opt.step()
        _check_params(model, ref_trained, mean_tol, max_tol, precision)
