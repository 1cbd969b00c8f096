"""Between steps ZeRO holds exactly the ZeRO formula's bytes, counted from parameter counts.

The bytes are measured, not taken from the optimizer's own bookkeeping: every tensor storage
reachable from the optimizer object (its attributes, containers, the wrapped torch optimizer's
state, the parameters and their ``.grad``) is counted once. Stage 2 must then hold its
parameters, master slices and optimizer-state slices only: no gradient slice and no bucket
buffer of the last step. Stage 1 keeps its full gradient buffer by design.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from zero_testlib import batch, local, loss_fn, make_model, make_optimizer

from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer

STEPS = 3


def held_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root``.

    Follows containers, ``functools.partial``, dataclasses and the ``__dict__`` of colossal
    and ``torch.optim`` objects; a tensor counts its whole storage (views share one) and its
    ``.grad``. Other objects (process groups, hook handles, modules of torch) are leaves.
    """
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith(
            ("colossal.", "torch.optim")
        ):
            stack.extend(getattr(obj, "__dict__", {}).values())
    return sum(storages.values())


def zero_formula(
    group_sizes: list[int], world_size: int, stage: int, width: int, fp32_masters: bool
) -> int:
    """Per-rank bytes between steps with AdamW, one bucket per param group.

    Args:
        group_sizes: Trainable elements of each param group.
        world_size: Data-parallel size (each group's bucket is padded to a multiple of it).
        stage: ZeRO stage.
        width: Bytes per element of the parameters (and of stage 1's gradient buffer).
        fp32_masters: Separate fp32 master slices (bf16/fp16 parameters).
    """
    padded = sum(-(-n // world_size) * world_size for n in group_sizes)
    shard = padded // world_size
    params = width * padded
    grads = width * padded if stage == 1 else 0  # stage 2: none between steps
    masters = 4 * shard if fp32_masters else 0  # fp32 masters are views of the params
    states = 2 * 4 * shard + 4 * len(group_sizes)  # exp_avg, exp_avg_sq; fp32 "step" scalars
    return params + grads + masters + states


@pytest.mark.parametrize(
    ("stage", "precision", "accumulate"),
    [(1, "fp32", 1), (1, "bf16", 2)]
    + [(2, precision, accumulate) for precision in ("fp32", "bf16") for accumulate in (1, 2)],
)
@distributed_test(2, 4)
def test_bytes_between_steps_follow_the_zero_formula(
    rank: int, world_size: int, stage: int, precision: str, accumulate: int
) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = make_model(dtype)
    inner = make_optimizer(model)
    group_sizes = [sum(p.numel() for p in g["params"]) for g in inner.param_groups]
    opt = LowLevelZeroOptimizer(inner, partition_grad=stage == 2, reduce_bucket_size=10**6)
    assert len(opt.buckets) == len(group_sizes), "expected one bucket per group"
    expected = zero_formula(group_sizes, world_size, stage, dtype.itemsize, dtype != torch.float32)
    x, y = batch(0)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):  # several backwards before a step (stage 2 reduces each)
            x, y = batch(step * accumulate + micro)
            opt.backward(loss_fn(model, local(x, rank, world_size), local(y, rank, world_size)))
        if stage == 2 and step:  # the slices exist during a step (states from step 1 on)
            assert held_bytes(opt) > expected
        opt.step()
        opt.wait_params()
        held = held_bytes(opt)
        assert held == expected, (
            f"step {step}: {held} bytes held between steps, the formula gives {expected} "
            f"({held - expected:+d}); report {opt.memory_report().as_dict()}"
        )
        assert opt.memory_report().total == expected  # the report agrees
