"""GeminiPlugin behind the Booster: training equals one process, and bad arguments fail early.

Every distributed check compares against a single-process AdamW run of the same model on the
same global batch (``booster_testlib``). Errors are per tensor, relative to the reference
tensor's norm (``relative_error``); the tolerances are those of ``test_equivalence`` (fp32
1e-5, fp16 2e-3, bf16 4e-2 after a few AdamW steps at lr 3e-2) and every case also checks
that the reference parameters move by more than ``MOVE_FACTOR`` tolerances, so a step that
is skipped or never applied fails.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from booster_testlib import (
    GLOBAL_BATCH,
    batch,
    local_batch,
    make_booster,
    make_model,
    make_optimizer,
    train_steps,
)
from torch import nn

from colossal.core.testing import distributed_test, relative_error
from colossal.lazy import LazyInitContext

STEPS = 5
LR = 3e-2
TOL = {"fp32": 1e-5, "bf16": 4e-2, "fp16": 2e-3}
MOVE_FACTOR = 3.0
#: fp32 runs that sum gradients in another order than the reference (micro-batches, the
#: clip factor): Adam's first steps amplify the rounding of near-zero gradient elements, so
#: per-tensor errors reach ~1.5e-5 (measured); the bugs they guard move tensors by > 1e-2.
TOL_REORDERED = 5e-5
#: Small chunks: the 435-parameter MLP spans several chunks, each sharded over the ranks.
CHUNK = {"chunk_size": 128}


def _reference(
    steps: int = STEPS, max_norm: float = 0.0, make: object = make_model
) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """One fp32 process on the global batch (optionally clipping like ``clip_grad_norm_``)."""
    model = make()
    optimizer = make_optimizer(model, lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def _check(what: str, model: nn.Module, losses: list[float], ref: tuple, tol: float) -> None:
    """Losses and every parameter/buffer of the boosted ``model`` match the reference."""
    ref_losses, ref_state, _ = ref
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= tol * abs(want), f"{what}: loss {got} != {want}"
    state = model.state_dict()  # GeminiDDP: full fp32 tensors, gathered chunk by chunk
    assert state.keys() == ref_state.keys(), what
    for name, want in ref_state.items():
        err = relative_error(state[name], want)
        assert err <= tol, f"{what}: {name} differs from the reference by {err:.2e} > {tol}"


def _moved(ref: tuple, start: dict[str, torch.Tensor], tol: float, what: str) -> None:
    for name, p in ref[2].named_parameters():
        move = relative_error(p.detach(), start[name])
        assert move > MOVE_FACTOR * tol, f"{what}: {name} moves only {move:.2e}"


@distributed_test(2)
def test_matches_single_process(rank: int, world_size: int) -> None:
    """fp32/bf16/fp16 training, clipping, accumulation, lazy init and placement at world 2.

    One spawn checks:

    - 5 steps in fp32, bf16 and fp16 equal the reference (catches gradients not averaged
      over the ranks, a precision not applied to the chunks, the loss scale not unscaled or
      the scaler settings not forwarded, the user's param groups dropped (weight decay
      differs per group));
    - ``max_norm`` equals ``clip_grad_norm_`` in the reference, which differs from the
      unclipped run (catches max_norm not forwarded to GeminiOptimizer);
    - ``enable_gradient_accumulation`` + ``booster.no_sync``: two half micro-batches per
      step equal the large batch (catches the flag not forwarded: the second backward
      replaces the first's gradients);
    - a model built under ``LazyInitContext`` trains the same (catches a lazy model wrapped
      before materializing, or the optimizer left on the lazy parameters);
    - static placement arguments reach GeminiDDP (``shard_param_frac=0`` keeps every chunk
      gathered, ``offload_optim_frac=1`` puts every master on the host) and train the same;
    - a ``torch.no_grad`` evaluation forward between steps gives the reference's output and
      does not disturb training (what ``examples/train_gpt.py`` does).
    """
    from colossal.gemini import GeminiDDP, GeminiOptimizer

    start = {k: v.clone() for k, v in make_model().state_dict().items()}
    ref = _reference()
    for precision in ("fp32", "bf16", "fp16"):
        tol = TOL[precision]
        _moved(ref, start, tol, precision)
        booster = make_booster("gemini", precision, chunk_config_dict=CHUNK, initial_scale=2**8)
        model = make_model()
        optimizer = make_optimizer(model, lr=LR)
        model, optimizer, *_ = booster.boost(model, optimizer)
        assert isinstance(model, GeminiDDP) and isinstance(optimizer, GeminiOptimizer)
        chunks = model.chunk_manager.chunks
        assert len(chunks) > 1 and all(c.shard.numel() < c.chunk_size for c in chunks)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        assert {c.dtype for c in chunks} == {dtype[precision]}
        losses = train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
        _check(precision, model, losses, ref, tol)
        assert optimizer.loss_scale == (2**8 if precision == "fp16" else 1.0)  # no overflow

    # clipping: the clip must bite (the clipped reference differs from the unclipped one)
    clipped = _reference(max_norm=0.5)
    assert relative_error(clipped[1]["head.weight"], ref[1]["head.weight"]) > 10 * TOL["fp16"]
    for precision in ("fp32", "fp16"):
        booster = make_booster("gemini", precision, chunk_config_dict=CHUNK, max_norm=0.5,
                               initial_scale=2**8)  # fmt: skip
        model = make_model()
        model, optimizer, *_ = booster.boost(model, make_optimizer(model, lr=LR))
        losses = train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
        tol = TOL_REORDERED if precision == "fp32" else TOL[precision]
        _check(f"clip {precision}", model, losses, clipped, tol)

    # gradient accumulation: two micro-batches of half the local batch per step
    booster = make_booster("gemini", "fp32", chunk_config_dict=CHUNK,
                           enable_gradient_accumulation=True)  # fmt: skip
    assert booster.plugin.support_no_sync()
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, lr=LR))
    half = GLOBAL_BATCH // world_size // 2
    losses = []
    for step in range(STEPS):
        x, y = local_batch(step, rank, world_size)
        with booster.no_sync(model, optimizer):
            first = nn.functional.mse_loss(model(x[:half]).float(), y[:half]) / 2
            booster.backward(first, optimizer)
        second = nn.functional.mse_loss(model(x[half:]).float(), y[half:]) / 2
        booster.backward(second, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        total = (first + second).detach()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world_size)
    _check("accumulation", model, losses, ref, TOL_REORDERED)

    # lazy init, and static placement arguments forwarded
    for kwargs in ({}, {"shard_param_frac": 0.0, "offload_optim_frac": 1.0}):
        booster = make_booster("gemini", "fp32", chunk_config_dict=CHUNK, **kwargs)
        with LazyInitContext():
            model = make_model()
        model, optimizer, *_ = booster.boost(model, make_optimizer(model, lr=LR))
        if kwargs:
            assert all(c.keep_gathered for c in model.chunk_manager.chunks)
            assert {c.master_location for c in model.chunk_manager.chunks} == {"host"}
        losses = train_steps(model, optimizer, booster, range(2), rank, world_size)
        eval_x = batch(99)[0]
        with torch.no_grad():
            got = model(eval_x).float()
        ref_model = copy.deepcopy(_reference(steps=2)[2])
        assert relative_error(got, ref_model(eval_x)) <= TOL["fp32"], f"eval {kwargs}"
        losses += train_steps(model, optimizer, booster, range(2, STEPS), rank, world_size)
        _check(f"lazy {kwargs}", model, losses, ref, TOL["fp32"])


@distributed_test(2)
def test_lora_trains_only_adapters(rank: int, world_size: int, tmp_path: Path) -> None:
    """``booster.enable_lora`` + GeminiPlugin: adapters train like the reference, base stays,
    and ``save_lora_as_pretrained`` writes the trained adapters.

    Catches frozen base weights entering the optimizer (state for them, weight decay moving
    them), adapters whose gradients are not averaged over the ranks, and an adapter saved
    from the parameters' released (empty) storage instead of the chunks.
    """
    peft = pytest.importorskip("peft")

    def config() -> object:  # random adapters (B != 0): every adapter gets a gradient
        return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed", "head"],
                               init_lora_weights=False)  # fmt: skip

    ref = peft.get_peft_model(make_model(), config())  # make_model seeds: same adapters
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    booster = make_booster("gemini", "fp32", chunk_config_dict=CHUNK)
    assert booster.plugin.support_lora()
    model = booster.enable_lora(make_model(), lora_config=config())
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert {v.name for v in optimizer.master_views} <= adapters
    train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    assert 0 < len(optimizer.optim.state) <= len(adapters)  # no state for a base weight
    state = model.state_dict()
    for name, want in ref.state_dict().items():
        if name in adapters:
            assert not torch.equal(state[name], initial[name]), f"{name} did not train"
            assert relative_error(state[name], want) <= TOL["fp32"], name
        else:
            assert torch.equal(state[name], initial[name]), f"base {name} changed"
    booster.save_lora_as_pretrained(model, str(tmp_path / "adapter"), use_safetensors=True)
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        assert len(saved) == len(adapters)
        for name in adapters:  # peft drops the adapter name ("default") when saving
            key = name.replace(".default", "")
            assert torch.equal(saved[key], state[name]), f"saved {key}"


def _plugin(**kwargs: object) -> object:
    from colossal.booster.plugin import GeminiPlugin

    return GeminiPlugin(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"extra_dp_size": 0}, ValueError, r"extra_dp_size=0 must be an int >= 1"),
        ({"enable_sequence_parallelism": True}, ValueError, r"needs tp_size > 1, got tp_size=1"),
        ({"tp_size": 0}, ValueError, r"tp_size=0 must be an int >= 1"),
        ({"placement_policy": "cuda"}, ValueError, r"placement_policy='cuda'.*'static'.*'auto'"),
        ({"shard_param_frac": 1.5}, ValueError, r"shard_param_frac=1.5 is outside \[0, 1\]"),
        ({"offload_optim_frac": -0.1}, ValueError, r"offload_optim_frac=-0.1 is outside"),
        ({"offload_param_frac": 2}, ValueError, r"offload_param_frac=2 is outside"),
        ({"steady_cuda_cap_ratio": 0.0}, ValueError, r"steady_cuda_cap_ratio=0.0.*\(0, 1\]"),
        ({"gpu_margin_mem_ratio": 1.1}, ValueError, r"gpu_margin_mem_ratio=1.1"),
        ({"precision": "fp8"}, ValueError, r"fp8"),
        ({"max_norm": -1.0}, ValueError, r"max_norm.*-1.0 must be >= 0"),
        ({"norm_type": 0}, ValueError, r"norm_type=0 must be > 0"),
        ({"hidden_dim": 0}, ValueError, r"hidden_dim=0 must be an int > 0"),
        ({"search_range_m": 0}, ValueError, r"search_range_m=0 must be > 0"),
        ({"initial_scale": 0.5}, ValueError, r"initial_scale=0.5 must lie in"),
        ({"memstats": {}}, TypeError, r"memstats must be a colossal.gemini.MemStats"),
        ({"chunk_init_device": 3.5}, TypeError, r"chunk_init_device=3.5 is not a device"),
    ],
)
def test_argument_errors(kwargs: dict, error: type, match: str) -> None:
    """Bad arguments fail before any process group is needed, naming the value and the fix.

    Catches a documented argument that is silently ignored or accepted out of range.
    """
    with pytest.raises(error, match=match):
        _plugin(**kwargs)


@distributed_test(1)
def test_accepted_arguments(rank: int, world_size: int) -> None:
    """Every documented argument is accepted at its documented default and CPU-only values.

    Catches a documented argument missing from the signature, a chunk config in
    ColossalAI's ``{dp_size: {...}}`` form not understood, and no_sync offered without
    gradient accumulation.
    """
    import inspect

    from colossal.booster import Booster

    plugin = _plugin(
        chunk_config_dict={1: {"chunk_size": 256, "keep_gathered": False}},
        chunk_init_device=torch.device("cpu"), pin_memory=True, gpu_margin_mem_ratio=0.5,
        hidden_dim=16, search_range_m=8, min_chunk_size_m=0.0, strict_ddp_mode=True,
        verbose=True, device_memory_limit="64MB",
    )  # fmt: skip
    assert plugin.chunk_config == {"chunk_size": 256, "keep_gathered": False}
    assert not plugin.support_no_sync()
    assert plugin.supported_precisions() == ["fp16", "bf16", "fp32"]
    documented = """chunk_config_dict chunk_init_device placement_policy
        enable_gradient_accumulation shard_param_frac offload_optim_frac offload_param_frac
        warmup_non_model_data_ratio steady_cuda_cap_ratio precision master_weights pin_memory
        force_outputs_fp32 strict_ddp_mode search_range_m hidden_dim min_chunk_size_m memstats
        gpu_margin_mem_ratio initial_scale min_scale growth_factor backoff_factor
        growth_interval hysteresis max_scale max_norm norm_type tp_size extra_dp_size
        enable_all_optimization enable_fused_normalization enable_flash_attention
        enable_sequence_parallelism enable_jit_fused enable_sequence_overlap verbose""".split()
    params = inspect.signature(type(plugin)).parameters
    assert [p for p in params if p in documented] == documented
    assert params["placement_policy"].default == "static" and params["precision"].default == "fp16"
    with pytest.raises(ValueError, match=r"keyed by data-parallel size \[2\].*this job's is 1"):
        _plugin(chunk_config_dict={2: {"chunk_size": 64}})
    with pytest.raises(ValueError, match=r"chunk_config_dict takes the keys"):
        _plugin(chunk_config_dict={"size": 64})
    booster = Booster(plugin=plugin)
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    with pytest.raises(NotImplementedError, match="enable_gradient_accumulation=True"):
        booster.plugin.no_sync(model, optimizer)



@distributed_test(1)
def test_fp16_on_cpu_warns_and_bf16_does_not(rank: int, world_size: int) -> None:
    """fp16 is emulated (13-24x slower than bf16) on the CPUs this runs on: each ZeRO plugin
    says so when built with it, and stays quiet for bf16."""
    from colossal.booster.plugin import GeminiPlugin, LowLevelZeroPlugin

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("colossal.booster.plugin.base").addHandler(handler)
    for cls in (GeminiPlugin, LowLevelZeroPlugin):
        seen.clear()
        cls(precision="bf16")
        assert not seen, seen
        cls(precision="fp16")
        assert len(seen) == 1 and cls.__name__ in seen[0] and "precision='bf16'" in seen[0]
