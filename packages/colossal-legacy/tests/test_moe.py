"""The seeds' MoE API: ``parallel=dict(moe=...)`` groups, layers, ``MoeLoss``, the handler.

Layout (ColossalAI's, the page's figure for world 4 and moe size 2): a MoE model-parallel
group is ``E`` consecutive data-parallel ranks ({0, 1}, {2, 3}); the MoE data-parallel
groups join the ranks holding the same experts across them ({0, 2}, {1, 3}).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.context import ParallelMode, moe_env, moe_set_seed, parse_parallel
from colossal.legacy.core import gpc
from colossal.legacy.engine.gradient_handler import MoeGradientHandler
from colossal.legacy.nn.layer.moe import Experts, MoeLayer, MoeLoss, Top2Router
from colossal.legacy.utils import save_checkpoint

HIDDEN, EXPERTS, CLASSES, TOKENS = 8, 4, 5, 6  # TOKENS per sample


class _FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _Tiny(nn.Module):
    """Embedding, one MoE block applied twice (shared weights, as WideNet), mean-pool head."""

    def __init__(self, all_local: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(3, HIDDEN)
        router = Top2Router(capacity_factor_train=None, capacity_factor_eval=None)  # dropless
        experts = Experts(_FFN, EXPERTS, all_local=all_local, d_model=HIDDEN, d_ff=16)
        self.moe = MoeLayer(HIDDEN, EXPERTS, router, experts)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(2):
            h = h + self.moe(h)
        return self.head(h.mean(dim=1))


def _expert_pairs(model: _Tiny, ref: _Tiny) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each local expert parameter with the one-process model's same global expert's."""
    first = model.moe.experts.first_expert
    pairs = []
    for local, expert in enumerate(model.moe.experts.experts):
        twin = ref.moe.experts.experts[first + local]
        pairs += list(zip(expert.parameters(), twin.parameters(), strict=True))
    return pairs


def test_moe_size_that_does_not_divide_is_named() -> None:
    """Catches: a moe size that does not divide the data-parallel size accepted (or named
    'ep' only, a name the config does not use); a bad moe value accepted."""
    with pytest.raises(ValueError, match=r"parallel.moe size 3 must divide.*divisors \[1, 2, 4\]"):
        parse_parallel(dict(moe=dict(size=3))).to_dims(4)
    with pytest.raises(ValueError, match=r"parallel.moe size must be a positive int, got 0"):
        parse_parallel(dict(moe=dict(size=0)))
    assert parse_parallel(dict(moe=2)).to_dims(4).ep == 2


def test_moe_loss_adds_the_weighted_aux_loss() -> None:
    """Catches: MoeLoss dropping the aux loss, weighting it wrongly, or keeping it for the
    next step (a second backward through a freed graph); kwargs not reaching loss_fn."""
    torch.manual_seed(0)
    layer = MoeLayer(
        HIDDEN, EXPERTS, Top2Router(None, None), Experts(_FFN, EXPERTS, d_model=8, d_ff=4)
    )
    logits, target = torch.randn(6, CLASSES), torch.randint(0, CLASSES, (6,))
    moe_env.reset_loss()
    layer(torch.randn(2, 5, HIDDEN))
    layer(torch.randn(3, HIDDEN))
    aux = moe_env.get_loss().detach()
    assert moe_env.num_pending_losses == 2 and aux.item() > 0.5  # ~1 each when balanced
    criterion = MoeLoss(aux_weight=0.25, loss_fn=nn.CrossEntropyLoss, label_smoothing=0.1)
    main = nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
    torch.testing.assert_close(criterion(logits, target), main + 0.25 * aux, rtol=0, atol=1e-6)
    assert moe_env.num_pending_losses == 0
    torch.testing.assert_close(criterion(logits, target), main, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"aux_weight must be >= 0, got -1"):
        MoeLoss(-1, nn.CrossEntropyLoss)


@pytest.mark.parametrize("clip", [0.0, 0.2])
@distributed_test(4)
def test_moe_groups_and_engine_steps_equal_one_process(
    rank: int, world_size: int, clip: float
) -> None:
    """Catches: MOE_MODEL / MOE_DATA groups of the wrong ranks; initialize not adding the
    MoeGradientHandler (or using DDP, which averages different experts together); expert
    gradients averaged over DATA or MOE_DATA alone (off by the moe size); experts seeded
    alike on every rank or differently from one process; expert parameters broadcast over
    DATA (overwriting other ranks' experts); save_checkpoint writing one rank's split
    experts under local names; with clip_grad_norm, a norm that counts an
    expert on every rank of its MOE_DATA group, or misses other ranks' experts."""
    torch.set_num_threads(1)
    init_context(dict(parallel=dict(moe=dict(size=2)), clip_grad_norm=clip), verbose=False)
    assert gpc.get_ranks_in_group(ParallelMode.MOE_MODEL) == [[0, 1], [0, 1], [2, 3], [2, 3]][rank]
    assert gpc.get_ranks_in_group(ParallelMode.MOE_DATA) == [[0, 2], [1, 3], [0, 2], [1, 3]][rank]
    assert gpc.get_ranks_in_group(ParallelMode.DATA) == [0, 1, 2, 3]
    assert moe_env.is_initialized and moe_env.model_parallel_size == 2
    assert moe_env.data_parallel_size == 2

    moe_set_seed(42)
    torch.manual_seed(0)
    model = _Tiny(all_local=False)
    torch.manual_seed(0)
    ref = _Tiny(all_local=True)
    assert len(model.moe.experts.experts) == 2 and len(ref.moe.experts.experts) == 4
    criterion = MoeLoss(aux_weight=0.1, loss_fn=nn.CrossEntropyLoss)
    engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), criterion)
    handlers = engine._gradient_handlers  # noqa: SLF001 - what initialize chose
    assert [type(h) for h in handlers] == [MoeGradientHandler], handlers
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for p, q in _expert_pairs(model, ref):  # the same start as one process
        torch.testing.assert_close(p, q, rtol=0, atol=0)

    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(8, TOKENS, 3, generator=gen)
        y = torch.randint(0, CLASSES, (8,), generator=gen)
        mine = slice(2 * rank, 2 * rank + 2)
        engine.zero_grad()
        loss = engine.criterion(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        total = sum(criterion(ref(x[s : s + 2]), y[s : s + 2]) for s in range(0, 8, 2)) / 4
        total.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert norm > 2 * clip, norm  # the clip acts
        ref_opt.step()
    for name, param in model.named_parameters():
        if ".experts." in name:
            continue
        torch.testing.assert_close(param, ref.get_parameter(name), rtol=1e-5, atol=1e-6)
    for p, q in _expert_pairs(model, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError, match=r"save_checkpoint: the experts are split"):
        save_checkpoint("/nonexistent/ckpt", 0, model)
    moe_env.reset_loss()
    gpc.destroy()
    for size, model_ranks, data_ranks in ((4, [0, 1, 2, 3], [rank]), (1, [rank], [0, 1, 2, 3])):
        init_context(dict(parallel=dict(moe=size)), verbose=False)
        assert gpc.get_ranks_in_group(ParallelMode.MOE_MODEL) == model_ranks, size
        assert gpc.get_ranks_in_group(ParallelMode.MOE_DATA) == data_ranks, size
        gpc.destroy()


@distributed_test(1)
def test_moe_misuse_is_named(rank: int, world_size: int) -> None:
    """Catches: ZeRO silently averaging expert gradients over DATA under moe; the MoE handler
    built without MoE groups; a non-module expert class or a layer/experts count mismatch
    accepted."""
    torch.set_num_threads(1)
    with pytest.raises(RuntimeError, match=r"MoeGradientHandler needs the MoE groups"):
        init_context(dict(), verbose=False)
        try:
            MoeGradientHandler(nn.Linear(2, 2), torch.optim.SGD([nn.Parameter(torch.ones(1))]))
        finally:
            gpc.destroy()
    init_context(dict(parallel=dict(moe=1), zero=dict(stage=1)), verbose=False)
    model = _Tiny(all_local=False)
    with pytest.raises(ValueError, match=r"zero=dict\(...\) with a MoE model"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"expert must be an nn.Module class, got 3"):
        Experts(3, EXPERTS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"experts hold 4 experts, the layer 2"):
        MoeLayer(HIDDEN, 2, Top2Router(), Experts(_FFN, EXPERTS, d_model=HIDDEN, d_ff=4))
    gpc.destroy()
