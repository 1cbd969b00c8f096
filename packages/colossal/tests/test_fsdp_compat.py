"""TorchFSDPPlugin's FSDP1 arguments (ColossalAI's documented signature) mapped onto FSDP2.

Each mapped argument is shown to change what FSDP2 does (and, where training is involved, to
train like the single-process reference); each refused one to fail with the replacement.
"""

from __future__ import annotations

import functools
import os

import booster_testlib
import pytest
import torch
import torch.distributed as dist
from booster_testlib import IN, Blocks, make_model, make_optimizer, train_steps
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from colossal.booster import Booster
from colossal.core.testing import distributed_test

STEPS = 3
TOL = 1e-5


#: Blocks in the test model (the wrap-policy tests name ``blocks.0`` and ``blocks.1``).
DEPTH = 2
make_blocks = functools.partial(booster_testlib.make_blocks, depth=DEPTH)


def _reference(steps: int) -> dict[str, torch.Tensor]:
    from booster_testlib import reference

    return reference(steps, make_blocks)[1]


def _plugin(**kwargs: object) -> object:
    from colossal.booster.plugin import TorchFSDPPlugin

    return TorchFSDPPlugin(**kwargs)


def _train(rank: int, world_size: int, **kwargs: object) -> tuple[object, object, dict]:
    booster = Booster(plugin=_plugin(**kwargs))
    model = make_blocks()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    return booster, model, full_state(model)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of a sharded model (collective), gathered by DTensor itself."""
    state = model.unwrap().state_dict()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
        for k, v in state.items()
    }


def _assert_matches_reference(state: dict, where: str) -> None:
    ref = _reference(STEPS)
    assert state.keys() == ref.keys(), where
    for name, value in ref.items():
        torch.testing.assert_close(
            state[name], value, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{where} {n}: {m}"
        )


def _gathered_after_forward(model: nn.Module) -> bool:
    """Whether a non-root unit keeps its gathered (plain) parameters after forward."""
    inner = model.unwrap().blocks[0][0] if hasattr(model, "unwrap") else model.blocks[0][0]
    model(torch.zeros(2, IN))
    return not isinstance(inner.weight, DTensor)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@distributed_test(2)
def test_sharding_strategies(rank: int, world_size: int) -> None:
    """FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD train like the reference, each as claimed.

    Catches: SHARD_GRAD_OP not mapped to reshard_after_forward=False (the gathered
    parameters would be freed after forward), HYBRID_SHARD not building the 2-D mesh, and
    any mapping that changes the numerics.
    """
    _, model, state = _train(rank, world_size, sharding_strategy=ShardingStrategy.FULL_SHARD)
    _assert_matches_reference(state, "FULL_SHARD")
    assert not _gathered_after_forward(model)

    _, model, state = _train(rank, world_size, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
    _assert_matches_reference(state, "SHARD_GRAD_OP")
    assert _gathered_after_forward(model), "SHARD_GRAD_OP must keep parameters after forward"

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two "nodes" of one rank: replicate 2 x shard 1
    try:
        _, model, state = _train(rank, world_size, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    finally:
        _restore("LOCAL_WORLD_SIZE", saved)
    weight = model.unwrap().embed.weight
    assert weight.device_mesh.mesh.shape == (2, 1)
    assert tuple(weight.placements) == (Replicate(), Shard(0))
    _assert_matches_reference(state, "HYBRID_SHARD")

    # One node: HYBRID_SHARD is FULL_SHARD over the node's ranks (a 1-D mesh).
    _, model, _ = _train(rank, world_size, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    assert model.unwrap().embed.weight.device_mesh.ndim == 1
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    try:
        booster = Booster(plugin=_plugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD))
        with pytest.raises(ValueError, match="not a multiple of LOCAL_WORLD_SIZE=3"):
            booster.boost(make_blocks())
    finally:
        _restore("LOCAL_WORLD_SIZE", saved)


@distributed_test(2)
def test_mixed_precision_and_process_group(rank: int, world_size: int) -> None:
    """mixed_precision's param_dtype is what forward computes in; process_group is the mesh.

    Catches: mixed_precision ignored (fp32 forward), reduce_dtype dropped, and
    process_group ignored (the default whole-job mesh would shard over both ranks).
    """
    seen: list[torch.dtype] = []
    booster = Booster(
        plugin=_plugin(
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        )
    )
    assert booster.plugin.mp_policy.param_dtype is torch.bfloat16
    assert booster.plugin.mp_policy.reduce_dtype is torch.float32
    model = make_blocks()
    model.head.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    model, *_ = booster.boost(model)
    out = model(torch.randn(2, IN))
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16
    assert model.unwrap().head.weight.dtype == torch.float32  # sharded masters stay fp32

    seen.clear()
    plain = make_blocks()
    plain.head.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    Booster(plugin=_plugin()).boost(plain)[0](torch.randn(2, IN))
    assert seen == [torch.float32]

    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank builds every group
    booster = Booster(plugin=_plugin(process_group=groups[rank]))
    model, *_ = booster.boost(make_blocks())
    weight = model.unwrap().embed.weight
    assert weight.device_mesh.size() == 1
    assert weight.to_local().shape == weight.shape  # alone in its group: nothing sharded


@distributed_test(2)
def test_ignored_modules_and_auto_wrap_policy(rank: int, world_size: int) -> None:
    """ignored_modules stay plain tensors; auto_wrap_policy picks the sharded units.

    Catches: ignored_modules not passed as ``ignored_params`` (head would be a DTensor), an
    auto_wrap_policy that is not applied (the ModuleList entries would be the units), and a
    recursive walk that differs from FSDP1's (size-based policy).
    """
    model = make_blocks()
    booster = Booster(plugin=_plugin(ignored_modules=[model.head]))
    boosted, *_ = booster.boost(model)
    inner = boosted.unwrap()
    assert all(not isinstance(p, DTensor) for p in inner.head.parameters())
    assert all(isinstance(p, DTensor) for p in inner.embed.parameters())
    assert isinstance(inner.blocks[0], FSDPModule)  # the default units without a policy

    def units(policy: object) -> set[str]:
        booster = Booster(plugin=_plugin(auto_wrap_policy=policy))
        boosted, *_ = booster.boost(make_blocks())
        inner = boosted.unwrap()
        return {n for n, m in inner.named_modules() if isinstance(m, FSDPModule) and n}

    linears = {"embed", "blocks.0.0", "blocks.1.0", "head"}
    assert units(ModuleWrapPolicy({nn.Linear})) == linears
    by_layer = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential}
    )
    assert units(by_layer) == {"blocks.0", "blocks.1"}
    assert units(CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 3)) == {
        "head"
    }
    # FSDP1's walk counts what is not in a unit yet: each block's Linear (156 params) is a
    # unit, so its Sequential (0 left) is not; embed has 84 >= 80, head 39 < 80.
    by_size = functools.partial(size_based_auto_wrap_policy, min_num_params=80)
    assert units(by_size) == {"embed", "blocks.0.0", "blocks.1.0"}

    def lambda_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or (isinstance(module, nn.Linear) and module.in_features == IN)

    assert units(lambda_policy) == {"embed"}

    # A policy'd model trains like the reference.
    _, _, state = _train(
        rank,
        world_size,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
    )
    _assert_matches_reference(state, "ModuleWrapPolicy")


def _meta_blocks() -> Blocks:
    with torch.device("meta"):
        return Blocks(DEPTH)


@distributed_test(2)
def test_sync_module_states_and_param_init_fn(rank: int, world_size: int) -> None:
    """sync_module_states makes rank-different inits rank 0's; param_init_fn fills meta models.

    Catches: no broadcast before sharding (rank 1's rows would come from its own init),
    param_init_fn not called or called after sharding (meta tensors reach fully_shard).
    """
    rank0 = make_blocks(seed=500)
    booster = Booster(plugin=_plugin(sync_module_states=True))
    model, *_ = booster.boost(make_blocks(seed=500 + rank))
    state = full_state(model)
    for name, value in rank0.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)

    booster = Booster(plugin=_plugin())  # without it the ranks' rows come from two inits
    model, *_ = booster.boost(make_blocks(seed=500 + rank))
    state = full_state(model)
    assert not torch.equal(state["embed.weight"], rank0.embed.weight.detach())

    source = make_blocks()
    by_module = dict(source.named_modules())
    meta = _meta_blocks()
    names = {id(m): n for n, m in meta.named_modules()}
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(names[id(module)])
        module.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            own = dict(by_module[names[id(module)]].named_parameters(recurse=False))
            for pname, param in module.named_parameters(recurse=False):
                param.copy_(own[pname])

    booster = Booster(plugin=_plugin(param_init_fn=init))
    model, optimizer, *_ = booster.boost(meta, make_optimizer(meta))
    assert sorted(calls) == sorted(n for n, m in source.named_modules() if isinstance(m, nn.Linear))
    train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    _assert_matches_reference(full_state(model), "param_init_fn")

    booster = Booster(plugin=_plugin(param_init_fn=lambda m: None))
    with pytest.raises(ValueError, match="left tensors on the meta device"):
        booster.boost(_meta_blocks())


@distributed_test(1)
def test_refused_arguments(rank: int, world_size: int) -> None:
    """Arguments without an FSDP2 meaning here fail and name the replacement."""
    with pytest.raises(ValueError, match="NO_SHARD.*TorchDDPPlugin"):
        _plugin(sharding_strategy=ShardingStrategy.NO_SHARD)
    with pytest.raises(ValueError, match="needs an accelerator"):
        _plugin(cpu_offload=CPUOffload(offload_params=True))
    with pytest.raises(ValueError, match="needs an accelerator"):
        _plugin(offload_policy=CPUOffloadPolicy())
    assert type(_plugin(cpu_offload=CPUOffload(offload_params=False)).offload_policy).__name__ == (
        "OffloadPolicy"
    )
    with pytest.raises(TypeError, match="buffer_dtype=torch.int32"):
        _plugin(mixed_precision=MixedPrecision(torch.bfloat16, buffer_dtype=torch.int32))
    with pytest.raises(ValueError, match="keep_low_precision_grads.*reduce_dtype"):
        _plugin(mixed_precision=MixedPrecision(torch.bfloat16, keep_low_precision_grads=True))
    with pytest.raises(ValueError, match="only one"):
        _plugin(mixed_precision=MixedPrecision(torch.bfloat16), precision="bf16")
    with pytest.raises(ValueError, match="reshard_after_forward=False"):
        _plugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, reshard_after_forward=True)
    with pytest.raises(ValueError, match="shard_module_types"):
        _plugin(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), shard_module_types=["Linear"])
    with pytest.raises(ValueError, match="dp_group"):
        _plugin(process_group=dist.group.WORLD, dp_group=dist.new_group([0]))
    with pytest.raises(TypeError, match="sharding_strategy"):
        _plugin(sharding_strategy="FULL_SHARD")
    with pytest.raises(TypeError, match="mixed_precision.*MixedPrecisionPolicy"):
        _plugin(mixed_precision=torch.bfloat16)
    with pytest.raises(TypeError, match="process_group"):
        _plugin(process_group=(dist.group.WORLD, dist.group.WORLD))
    with pytest.raises(TypeError, match="param_init_fn"):
        _plugin(param_init_fn=3)
    with pytest.raises(TypeError, match="ignored_modules"):
        _plugin(ignored_modules=["head"])
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        _plugin(auto_wrap_policy={"Linear"})
    with pytest.raises(ValueError, match="per-module FSDP1 arguments"):
        booster = Booster(plugin=_plugin(auto_wrap_policy=CustomPolicy(lambda m: {"x": 1})))
        booster.boost(make_model())
    # FSDP2-style arguments keep working and default to FULL_SHARD.
    assert _plugin().config.reshard_after_forward is True
    assert _plugin(reshard_after_forward=False).config.reshard_after_forward is False


class _WithBuffers(nn.Module):
    """A layer scaled by a float buffer, with an integer buffer and an ignored child."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.3))
        self.register_buffer("steps", torch.tensor(3))
        self.side = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@distributed_test(2)
def test_mixed_precision_buffer_dtype(rank: int, world_size: int) -> None:
    """FSDP1's ``MixedPrecision(buffer_dtype=...)`` casts the floating-point buffers before
    ``fully_shard`` (eager and lazy models), as FSDP1 runs forward with them.

    Catches: buffer_dtype refused or ignored (scale left fp32: the output would differ from
    the bf16 reference by more than bf16 rounding of 1.3), integer buffers cast, an ignored
    module's buffers cast, a lazy buffer materialized with its fp32 value or left on meta.
    """
    from colossal.lazy import LazyInitContext

    torch.manual_seed(0)
    reference = _WithBuffers()
    x = torch.randn(5, 4)
    lin = reference.lin
    expected = nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    expected = expected * torch.full((4,), 1.3).bfloat16()
    assert (expected.float() - (lin(x) * 1.3)).abs().max() > 1e-3  # bf16 shows
    for lazy in (False, True):
        torch.manual_seed(0)
        if lazy:
            with LazyInitContext():
                model = _WithBuffers()
        else:
            model = _WithBuffers()
        mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        plugin = _plugin(mixed_precision=mp, ignored_modules=[model.side])
        boosted, *_ = Booster(plugin=plugin).boost(model)
        inner = boosted.unwrap()
        assert inner.scale.dtype == torch.bfloat16 and not inner.scale.is_meta, lazy
        assert torch.equal(inner.scale, torch.full((4,), 1.3).bfloat16()), lazy
        assert inner.steps.dtype == torch.int64 and int(inner.steps) == 3, lazy
        assert inner.side.running_mean.dtype == torch.float32, lazy
        out = boosted(x)
        assert out.dtype == torch.bfloat16, lazy
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"lazy={lazy}")
