"""colossal.legacy.nn: Lamb against a hand computation, CrossEntropyLoss, Accuracy, schedulers."""

from __future__ import annotations

import math

import pytest
import torch

import colossal.nn.lr_scheduler as meta_schedulers
from colossal.legacy.nn import Accuracy, CrossEntropyLoss, Lamb, lr_scheduler
from colossal.legacy.nn.metric import calc_acc

# ---- Lamb --------------------------------------------------------------------------------------


def _lamb_by_hand(
    w: list[float],
    grads: list[list[float]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    clamp: float | None,
    adam: bool = False,
    bias_correction: bool = False,
) -> tuple[list[float], float]:
    """LAMB on a list of floats, written from the paper's formulas; (weights, last trust)."""
    b1, b2 = betas
    m, v = [0.0] * len(w), [0.0] * len(w)
    trust = math.nan
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g, strict=True)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g, strict=True)]
        mh = [mi / (1 - b1**t) for mi in m] if bias_correction else m
        vh = [vi / (1 - b2**t) for vi in v] if bias_correction else v
        r = [a / (math.sqrt(b) + eps) + wd * wi for a, b, wi in zip(mh, vh, w, strict=True)]
        w_norm = math.sqrt(sum(x * x for x in w))
        if clamp is not None:
            w_norm = min(w_norm, clamp)
        r_norm = math.sqrt(sum(x * x for x in r))
        trust = 1.0 if adam or w_norm == 0 or r_norm == 0 else w_norm / r_norm
        w = [wi - lr * trust * ri for wi, ri in zip(w, r, strict=True)]
    return w, trust


def _lamb_by_torch(w: list[float], grads: list[list[float]], **kwargs: object) -> tuple:
    p = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))
    opt = Lamb([p], **kwargs)  # type: ignore[arg-type]
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach().tolist(), float(opt.state[p]["trust_ratio"])


def test_lamb_first_step_matches_the_numbers_worked_out_by_hand() -> None:
    # w = (3, 4): |w| = 5; g = (0.1, -0.2); m = 0.1 g, v = 0.01 g^2, so m / sqrt(v) = sign(g)
    # (up to eps); r = (1.0299, -0.95995) with weight decay 0.01; trust = 5 / |r| = 3.55137.
    w, trust = _lamb_by_torch(
        [3.0, 4.0], [[0.1, -0.2]], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01
    )
    assert trust == pytest.approx(3.5513746, rel=1e-7)
    assert w == pytest.approx([2.6342439271, 4.3409142050], rel=1e-9)


@pytest.mark.parametrize(
    ("w", "options"),
    [
        ([3.0, 4.0, -1.0], dict(weight_decay=0.01)),  # |w| < 10: no clamping
        ([30.0, 40.0, -10.0], dict(weight_decay=0.01)),  # |w| = 51: clamped to 10
        ([30.0, 40.0, -10.0], dict(clamp_value=None)),  # ColossalAI's unclamped ratio
        ([0.0, 0.0, 0.0], dict()),  # |w| = 0: trust 1
        ([3.0, 4.0, -1.0], dict(adam=True, weight_decay=0.1)),  # trust always 1
        ([3.0, 4.0, -1.0], dict(bias_correction=True)),
    ],
)
def test_lamb_three_steps_match_the_formulas(w: list[float], options: dict) -> None:
    grads = [[0.1, -0.2, 0.05], [0.3, 0.1, -0.4], [-0.2, 0.2, 0.1]]
    kwargs: dict = {**dict(lr=0.05, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0), **options}
    got, trust = _lamb_by_torch(w, grads, **kwargs)
    hand = dict(
        lr=kwargs["lr"],
        betas=kwargs["betas"],
        eps=kwargs["eps"],
        wd=kwargs["weight_decay"],
        adam=bool(options.get("adam", False)),
        bias_correction=bool(options.get("bias_correction", False)),
    )
    want, want_trust = _lamb_by_hand(w, grads, clamp=kwargs.get("clamp_value", 10.0), **hand)
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert trust == pytest.approx(want_trust, rel=1e-10)
    if w[0] == 30.0 and "clamp_value" not in options:  # the clamp matters here
        unclamped, _ = _lamb_by_hand(w, grads, clamp=None, **hand)
        assert max(abs(a - b) for a, b in zip(got, unclamped, strict=True)) > 0.1


def test_lamb_refuses_bad_hyper_parameters() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0 must be in \[0, 1\)"):
        Lamb(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1"):
        Lamb(p, lr=-1)
    with pytest.raises(ValueError, match="clamp_value=0"):
        Lamb(p, clamp_value=0)


# ---- loss, accuracy, schedulers ----------------------------------------------------------------


def test_cross_entropy_reductions_equal_torch() -> None:
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g)
    torch_loss = torch.nn.functional.cross_entropy
    assert torch.equal(CrossEntropyLoss()(logits, labels), torch_loss(logits, labels))
    none = CrossEntropyLoss(reduction=False)(logits, labels)
    assert none.shape == (6,) and torch.equal(none, torch_loss(logits, labels, reduction="none"))
    assert torch.equal(
        CrossEntropyLoss(reduction="sum", label_smoothing=0.1)(logits, labels),
        torch_loss(logits, labels, reduction="sum", label_smoothing=0.1),
    )
    with pytest.raises(ValueError, match="reduction='avg'"):
        CrossEntropyLoss(reduction="avg")


def test_accuracy_counts_correct_top1_predictions() -> None:
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert int(Accuracy()(logits, torch.tensor([1, 0, 0, 1]))) == 2
    tokens = torch.zeros(2, 3, 5)
    tokens[..., 2] = 1.0  # predicts class 2 at every position
    assert int(calc_acc(tokens, torch.tensor([[2, 2, 0], [2, 1, 2]]))) == 4
    with pytest.raises(ValueError, match=r"targets of shape \(4,\)"):
        Accuracy()(logits, torch.tensor([[1], [0], [0], [1]]))
    with pytest.raises(NotImplementedError, match="'2d'"):
        Accuracy(tensor_parallel="2d")


def test_lr_schedulers_are_the_meta_packages() -> None:
    for name in meta_schedulers.__all__:
        assert getattr(lr_scheduler, name) is getattr(meta_schedulers, name)
