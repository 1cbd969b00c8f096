"""colossal.nn.lr_scheduler: every step's rate against its formula, resume, bad arguments.

The reference rates are written out here from each formula, independently of the library's
helpers, for two parameter groups with different initial rates (a scheduler that ignores the
group's own base rate fails). Each schedule runs past ``total_steps`` so the warmup boundary,
the end and the hold after it are all compared.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from colossal.booster import Booster
from colossal.core import OptimizerWrapper
from colossal.nn import lr_scheduler as sched

BASES = (0.1, 0.03)
TOTAL = 30
STEPS = 34  # a few steps past TOTAL: the schedule must hold its final value
PI = math.pi


def _optimizer(momentum: float = 0.9) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    a, b = nn.Linear(2, 2), nn.Linear(2, 1)
    return torch.optim.SGD(
        [{"params": a.parameters(), "lr": BASES[0]}, {"params": b.parameters(), "lr": BASES[1]}],
        lr=BASES[0],
        momentum=momentum,
    )


def _half_cos(t: int, n: int, start: float, end: float) -> float:
    if n == 0:
        return end
    t = min(t, n)
    return end + 0.5 * (start - end) * (1 + math.cos(PI * t / n))


# name -> (constructor, reference lr(step, base))
Case = tuple[Callable[[torch.optim.Optimizer], Any], Callable[[int, float], float]]


def _cosine_warmup(s: int, b: float) -> float:
    # warmup 6: b/6, 2b/6, ..., b at step 5; cosine over 24 steps from b to 0.01
    return b * (s + 1) / 6 if s < 6 else _half_cos(s - 6, 24, b, 0.01)


def _linear_warmup(s: int, b: float) -> float:
    # warmup 5: b/6 ... 5b/6; then b at step 5 decaying linearly to 0 at step 30, then 0
    return b * (s + 1) / 6 if s < 5 else b * max(30 - s, 0) / 25


def _flat_warmup(s: int, b: float) -> float:
    # warmup 4, flat int(26 * 0.5) = 13 steps (4..16), cosine over 13 steps to 0.002
    if s < 4:
        return b * (s + 1) / 4
    if s < 17:
        return b
    return _half_cos(s - 17, 13, b, 0.002)


def _poly_warmup(s: int, b: float) -> float:
    if s < 3:
        return b * (s + 1) / 3
    return (b - 1e-3) * (1 - min(s - 3, 27) / 27) ** 2 + 1e-3


def _multistep_warmup(s: int, b: float) -> float:
    # milestone 4 lies inside the warmup and is ignored
    if s < 6:
        return b * (s + 1) / 6
    return b * 0.5 ** sum(1 for m in (4, 10, 20) if 6 <= m <= s)


CASES: dict[str, Case] = {
    "cosine": (
        lambda o: sched.CosineAnnealingLR(o, total_steps=TOTAL, eta_min=0.001),
        lambda s, b: _half_cos(s, 30, b, 0.001),
    ),
    "cosine_warmup": (
        lambda o: sched.CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=6, eta_min=0.01),
        _cosine_warmup,
    ),
    "cosine_warmup_defaults": (
        lambda o: sched.CosineAnnealingWarmupLR(o, TOTAL),
        lambda s, b: _half_cos(s, 30, b, 0.0),
    ),
    "cosine_warmup_all_warmup": (
        lambda o: sched.CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=TOTAL, eta_min=0.005),
        lambda s, b: b * (s + 1) / 30 if s < 30 else 0.005,
    ),
    "flat": (
        lambda o: sched.FlatAnnealingLR(o, TOTAL),  # pct_start 0.72 -> 21 flat steps
        lambda s, b: b if s < 21 else _half_cos(s - 21, 9, b, 0.0),
    ),
    "flat_warmup": (
        lambda o: sched.FlatAnnealingWarmupLR(o, TOTAL, 4, pct_start=0.5, eta_min=0.002),
        _flat_warmup,
    ),
    "linear_warmup": (lambda o: sched.LinearWarmupLR(o, TOTAL, warmup_steps=5), _linear_warmup),
    "linear_no_warmup": (
        lambda o: sched.LinearWarmupLR(o, total_steps=TOTAL),
        lambda s, b: b * max(30 - s, 0) / 30,
    ),
    "multistep": (
        lambda o: sched.MultiStepLR(o, TOTAL, milestones=[3, 10, 25], gamma=0.2),
        lambda s, b: b * 0.2 ** sum(1 for m in (3, 10, 25) if m <= s),
    ),
    "multistep_warmup": (
        lambda o: sched.MultiStepWarmupLR(o, TOTAL, 6, milestones=[4, 10, 20], gamma=0.5),
        _multistep_warmup,
    ),
    "poly": (
        lambda o: sched.PolynomialLR(o, TOTAL, end_lr=0.002, power=1.5),
        lambda s, b: (b - 0.002) * (1 - min(s, 30) / 30) ** 1.5 + 0.002,
    ),
    "poly_warmup": (
        lambda o: sched.PolynomialWarmupLR(o, TOTAL, 3, end_lr=1e-3, power=2.0),
        _poly_warmup,
    ),
    "step": (
        lambda o: sched.StepLR(o, TOTAL, step_size=7, gamma=0.5),
        lambda s, b: b * 0.5 ** (s // 7),
    ),
    "step_defaults": (lambda o: sched.StepLR(o, TOTAL), lambda s, b: b * 0.1**s),
    "exponential": (
        lambda o: sched.ExponentialLR(o, TOTAL, gamma=0.9),
        lambda s, b: b * 0.9**s,
    ),
    "exponential_default_keeps_rate": (lambda o: sched.ExponentialLR(o, TOTAL), lambda s, b: b),
    "lambda": (
        lambda o: sched.LambdaLR(o, TOTAL, lr_lambda=lambda s: 1 / (1 + s)),
        lambda s, b: b / (1 + s),
    ),
    "multiplicative": (
        lambda o: sched.MultiplicativeLR(o, TOTAL, lr_lambda=lambda s: 0.95),
        lambda s, b: b * 0.95**s,
    ),
}


def _lrs(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int) -> list[list[float]]:
    """The rate of each group at steps 0..steps-1, read from the optimizer."""
    out = []
    for step in range(steps):
        if step:
            optimizer.step()
            scheduler.step()
        got = [float(g["lr"]) for g in optimizer.param_groups]
        assert got == pytest.approx([float(x) for x in scheduler.get_last_lr()], rel=1e-12)
        out.append(got)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_step_equals_the_formula(name: str) -> None:
    """Catches: off-by-one at the warmup boundary, a wrong end/hold value, ignoring eta_min,
    end_lr or the group's own base rate, milestones inside the warmup counted."""
    make, formula = CASES[name]
    optimizer = _optimizer()
    scheduler = make(optimizer)
    got = _lrs(scheduler, optimizer, STEPS)
    want = [[formula(s, b) for b in BASES] for s in range(STEPS)]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-15), f"{name} step {step}"


def _one_cycle_reference(s: int, b: float, total: int, pct: float, strategy: str) -> float:
    initial, final = b / 25.0, b / 25.0 / 1e4
    peak = pct * total - 1
    if strategy == "cos":
        anneal = lambda x, y, f: y + (x - y) * (1 + math.cos(PI * f)) / 2  # noqa: E731
    else:
        anneal = lambda x, y, f: x + (y - x) * f  # noqa: E731
    if s <= peak:
        return anneal(initial, b, s / peak)
    return anneal(b, final, (s - peak) / (total - 1 - peak))


@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_one_cycle_equals_the_formula(strategy: str) -> None:
    """Catches: max_lr not taken from each group's rate, ColossalAI's defaults not applied."""
    optimizer = _optimizer()
    scheduler = sched.OneCycleLR(optimizer, TOTAL, pct_start=0.4, anneal_strategy=strategy)
    got = _lrs(scheduler, optimizer, TOTAL)
    for s in range(TOTAL):
        want = [_one_cycle_reference(s, b, TOTAL, 0.4, strategy) for b in BASES]
        assert got[s] == pytest.approx(want, rel=1e-9), s
    # momentum cycles inversely to the rate and is back at max_momentum at the end
    assert optimizer.param_groups[0]["momentum"] == pytest.approx(0.95)


def _resume_cases() -> list[str]:
    return sorted([*CASES, "one_cycle"])


def _make(name: str, optimizer: torch.optim.Optimizer, last_epoch: int = -1) -> Any:
    if name == "one_cycle":
        return sched.OneCycleLR(optimizer, TOTAL, last_epoch=last_epoch)
    return CASES[name][0](optimizer)


@pytest.mark.parametrize("name", _resume_cases())
def test_state_dict_round_trip_through_json_continues_identically(name: str) -> None:
    """Catches: a schedule whose position or arguments are not in its state (a resumed run
    would restart the warmup or use the fresh object's arguments)."""
    steps = TOTAL - 1 if name == "one_cycle" else STEPS
    optimizer = _optimizer()
    scheduler = _make(name, optimizer)
    straight = _lrs(scheduler, optimizer, steps)

    optimizer = _optimizer()
    scheduler = _make(name, optimizer)
    first = _lrs(scheduler, optimizer, 12)
    saved_sched = json.loads(json.dumps(_jsonable(scheduler.state_dict())))
    saved_optim = optimizer.state_dict()

    # The order of a resumed script: build both, then load the optimizer, then the scheduler.
    resumed_optim = _optimizer()
    resumed = _make(name, resumed_optim)  # fresh: its own position is step 0
    resumed_optim.load_state_dict(saved_optim)
    resumed.load_state_dict(saved_sched)
    rest = []
    for _ in range(12, steps):
        resumed_optim.step()
        resumed.step()
        rest.append([float(g["lr"]) for g in resumed_optim.param_groups])
    _assert_rows_equal(first + rest, straight)


def _assert_rows_equal(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"step {step}"


def _jsonable(value: Any) -> Any:
    # What the Booster's checkpoint IO writes: functions are dropped, tensors become lists.
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if callable(value):
        return None
    return value


@pytest.mark.parametrize("name", ["cosine_warmup", "multistep_warmup", "flat_warmup"])
def test_booster_saves_and_loads_the_scheduler(tmp_path: Any, name: str) -> None:
    """Catches: state the Booster's JSON writer cannot hold, or that does not resume."""
    booster = Booster()
    optimizer = _optimizer()
    scheduler = CASES[name][0](optimizer)
    straight = _lrs(scheduler, optimizer, STEPS)

    optimizer = _optimizer()
    scheduler = CASES[name][0](optimizer)
    _lrs(scheduler, optimizer, 9)
    path = str(tmp_path / "lr_scheduler.json")
    booster.save_lr_scheduler(scheduler, path)
    fresh_optimizer = _optimizer()
    fresh = CASES[name][0](fresh_optimizer)
    booster.load_lr_scheduler(fresh, path)
    assert fresh.last_epoch == 8
    rest = []
    for _ in range(9, STEPS):
        fresh_optimizer.step()
        fresh.step()
        rest.append([float(g["lr"]) for g in fresh_optimizer.param_groups])
    _assert_rows_equal(rest, straight[9:])


def test_step_with_epoch_jumps_exactly() -> None:
    """Catches: a recursive formula (stepping to an epoch would be wrong)."""
    optimizer = _optimizer()
    scheduler = sched.CosineAnnealingWarmupLR(optimizer, TOTAL, warmup_steps=6, eta_min=0.01)
    with pytest.warns(UserWarning):  # torch deprecates the epoch argument
        scheduler.step(17)
    assert scheduler.get_last_lr() == pytest.approx([_cosine_warmup(17, b) for b in BASES])


def test_accepts_the_boosted_optimizer_wrapper() -> None:
    optimizer = _optimizer()
    scheduler = sched.LinearWarmupLR(OptimizerWrapper(optimizer), TOTAL, warmup_steps=5)
    assert scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(BASES[0] / 6)


@pytest.mark.parametrize(
    ("make", "error", "names"),
    [
        (lambda o: sched.CosineAnnealingWarmupLR(o, 10, warmup_steps=11), ValueError,
         ["warmup_steps=11", "total_steps=10"]),
        (lambda o: sched.LinearWarmupLR(o, 10, warmup_steps=-1), ValueError, ["warmup_steps"]),
        (lambda o: sched.PolynomialWarmupLR(o, 5, warmup_steps=6), ValueError,
         ["warmup_steps=6", "total_steps=5"]),
        (lambda o: sched.FlatAnnealingWarmupLR(o, 5, warmup_steps=9), ValueError,
         ["warmup_steps=9"]),
        (lambda o: sched.MultiStepWarmupLR(o, 5, 9, milestones=[1]), ValueError,
         ["warmup_steps=9"]),
        (lambda o: sched.CosineAnnealingLR(o, 0), ValueError, ["total_steps"]),
        (lambda o: sched.CosineAnnealingLR(o, -3), ValueError, ["total_steps"]),
        (lambda o: sched.CosineAnnealingLR(o, 10, eta_min=-0.1), ValueError, ["eta_min"]),
        (lambda o: sched.CosineAnnealingLR(o, 10.5), TypeError, ["total_steps"]),
        (lambda o: sched.FlatAnnealingLR(o, 10, pct_start=1.5), ValueError, ["pct_start"]),
        (lambda o: sched.MultiStepLR(o, 10), ValueError, ["milestones"]),
        (lambda o: sched.MultiStepLR(o, 10, milestones=[5, 3]), ValueError, ["milestones"]),
        (lambda o: sched.StepLR(o, 10, step_size=0), ValueError, ["step_size"]),
        (lambda o: sched.ExponentialLR(o, 10, gamma=0.0), ValueError, ["gamma"]),
        (lambda o: sched.PolynomialLR(o, 10, end_lr=-1.0), ValueError, ["end_lr"]),
        (lambda o: sched.PolynomialLR(o, 10, power=0.0), ValueError, ["power"]),
        (lambda o: sched.LambdaLR(o, 10), ValueError, ["lr_lambda"]),
        (lambda o: sched.MultiplicativeLR(o, 10), ValueError, ["lr_lambda"]),
        (lambda o: sched.OneCycleLR(o, 0), ValueError, ["total_steps"]),
        (lambda o: sched.LinearWarmupLR(o, 10, last_epoch=-2), ValueError, ["last_epoch"]),
        (lambda o: sched.LinearWarmupLR(object(), 10), TypeError, ["optimizer"]),  # noqa: ARG005
    ],
)  # fmt: skip
def test_bad_arguments_are_named(
    make: Callable[[torch.optim.Optimizer], Any], error: type[Exception], names: list[str]
) -> None:
    with pytest.raises(error) as info:
        make(_optimizer())
    for name in names:
        assert name in str(info.value)


def test_public_names() -> None:
    assert set(sched.__all__) == {
        "CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR",
        "FlatAnnealingWarmupLR", "LinearWarmupLR", "MultiStepLR", "MultiStepWarmupLR",
        "OneCycleLR", "PolynomialLR", "PolynomialWarmupLR", "ExponentialLR", "LambdaLR",
        "MultiplicativeLR", "StepLR",
    }  # fmt: skip
    for name in sched.__all__:
        assert issubclass(getattr(sched, name), torch.optim.lr_scheduler.LRScheduler)
