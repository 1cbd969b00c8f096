"""GeminiPlugin(tp_size=2): Gemini's chunks next to Shardformer's tensor parallelism.

Each case trains a tiny transformers model (GPT-2 with tied embeddings, also with a
vocabulary of 100 that Shardformer pads to 128, or Llama) for 3 steps through the Booster
with ``GeminiPlugin(tp_size=2)`` and compares it with the unsharded model trained by one
process on the whole batch (:func:`_reference`): the loss of
every step (averaged over the data-parallel ranks) and every parameter afterwards (gathered
from the chunks, tensor-parallel parts joined), at a relative error of ``TOL`` in fp32. SGD
with momentum keeps a gradient scaled wrongly visible in every step. The clipping case
checks the global norm, which must count each parameter once over tp x dp: GPT-2's
parameters replicated over tp hold most of its squared gradient norm (counted on every tp
rank, the norm is about 20% off and every clipped step differs).

What a wrong composition gives: chunks sharded over the job instead of the dp group (wrong
averages), the user's optimizer left on the unsplit parameters (nothing trains), batches
not split by the dp coordinate, sequence-partial norm gradients not summed over tp, a norm
or an overflow verdict reduced over dp only, a checkpoint holding tensor-parallel parts
instead of full tensors or with the vocabulary's padding rows (``from_pretrained`` fails
on the shapes), optimizer states not restored or not in the one format (the step resumed
by the same layout, or by plain Gemini over all ranks, differs).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hybrid_testlib import GLOBAL_BATCH, MODELS, SEQ, VOCAB, make_optimizer, mean_over, rows
from torch import nn

from colossal.booster import Booster
from colossal.core import LocalShard, shard_spec
from colossal.core.comm import all_gather_object
from colossal.core.testing import distributed_test, relative_error

STEPS = 3
TOL = 2e-5
CLIP = 0.5  # below the reference's gradient norms (about 1-3): every step is clipped
NORM_TOL = 1e-5
#: bf16: the loss against the fp32 reference, and the weight updates of all parameters
#: together (a missing or doubled step is off by 0.3 or more).
MIXED_TOL = 2e-2
UPDATE_TOL = 0.1
#: Small chunks: every model spans several chunks, parameters cross the dp shards' borders.
CHUNK = {"chunk_size": 2048}
PADDED_VOCAB = 100  # Shardformer pads it to 128 (make_vocab_size_divisible_by=64 x tp 2)


def _gpt2_padded() -> nn.Module:
    """GPT-2 as ``hybrid_testlib.gpt2`` (2 layers) with a vocabulary tp does not divide."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=PADDED_VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


BUILD = {**MODELS, "gpt2_padded": _gpt2_padded}


def _batch(step: int, model_name: str) -> dict[str, torch.Tensor]:
    """Token ids within the model's vocabulary, labels equal to the inputs."""
    vocab = PADDED_VOCAB if model_name == "gpt2_padded" else VOCAB
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _reference(
    model_name: str, kind: str, max_norm: float = 0.0
) -> tuple[list[float], list[float], nn.Module]:
    """Losses, gradient norms and the model after ``STEPS`` on the global batch (fp32)."""
    model = BUILD[model_name]()
    opt = make_optimizer(model, kind)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(**_batch(step, model_name)).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm else float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model


def _full(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the boosted model as the whole fp32 tensor (collective)."""
    state = model.state_dict()  # GeminiDDP: this rank's parts, gathered over dp
    out = {}
    for name, p in model.unwrap().named_parameters(remove_duplicate=False):
        value, spec = state[name], shard_spec(p)
        if spec is not None:
            value = LocalShard(value, spec.part, spec.shape, spec.group).gather()
        out[name] = value
    return out


def _boost(model_name: str, kind: str, tp_size: int = 2, **kwargs: Any
           ) -> tuple[Booster, Any, Any]:
    from colossal.booster.plugin import GeminiPlugin

    plugin = GeminiPlugin(tp_size=tp_size, chunk_config_dict=CHUNK, initial_scale=2**10,
                          **kwargs)
    booster = Booster(plugin=plugin)
    model = BUILD[model_name]()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, kind))
    return booster, model, optimizer


def _step(booster: Booster, model: Any, optimizer: Any, step: int, model_name: str) -> float:
    plugin = booster.plugin
    batch = rows(_batch(step, model_name), plugin.parallel_dims.coordinate("dp"), plugin.dp_size)
    optimizer.zero_grad()
    loss = model(**batch).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    return mean_over(loss.item(), plugin.dp_group)


def _train(
    model_name: str, kind: str, max_norm: float = 0.0, precision: str = "fp32", **kwargs: Any
) -> tuple[Booster, Any, Any]:
    """Train ``STEPS`` steps and compare with one process; returns the boosted objects."""
    ref_losses, ref_norms, ref = _reference(model_name, kind, max_norm)
    if max_norm:
        assert min(ref_norms) > max_norm, ref_norms  # clipping changes every step
    booster, model, optimizer = _boost(model_name, kind, max_norm=max_norm,
                                       precision=precision, **kwargs)
    what = f"{model_name} {precision} max_norm={max_norm} {kwargs}"
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(_step(booster, model, optimizer, step, model_name))
        norms.append(optimizer.get_grad_norm())
    tol = TOL if precision == "fp32" else MIXED_TOL
    err = relative_error(torch.tensor(losses), torch.tensor(ref_losses))
    assert err <= tol, f"{what}: losses {losses} vs {ref_losses}"
    if max_norm:
        err = relative_error(torch.tensor(norms), torch.tensor(ref_norms))
        assert err <= NORM_TOL, f"{what}: norms {norms} vs {ref_norms}"
    expected = dict(ref.named_parameters(remove_duplicate=False))
    initial = dict(BUILD[model_name]().named_parameters(remove_duplicate=False))
    got = _full(model)
    assert got.keys() == expected.keys(), what
    mine, theirs = [], []
    for name, value in got.items():
        start = initial[name].detach()
        mine.append((value - start).flatten())
        theirs.append((expected[name].detach() - start).flatten())
        if precision == "fp32":
            err = relative_error(value, expected[name].detach())
            assert err <= TOL, f"{what}: {name} relative error {err:.2e}"
    err = relative_error(torch.cat(mine), torch.cat(theirs))
    assert err <= (TOL if precision == "fp32" else UPDATE_TOL), f"{what}: updates {err:.2e}"
    return booster, model, optimizer


def _shared_dir() -> str:
    path = tempfile.mkdtemp(prefix="gemini_tp_") if dist.get_rank() == 0 else None
    return all_gather_object(path)[0]


def _check_round_trip(booster: Booster, model: Any, optimizer: Any, model_name: str,
                      kind: str) -> None:
    """Save model and optimizer; ``from_pretrained`` and a fresh job load them and agree."""
    path = _shared_dir()
    try:
        booster.save_model(model, path, shard=True, size_per_shard=1)
        booster.save_optimizer(optimizer, path, shard=True, size_per_shard=1)
        trained = _full(model)
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(path)
            for name, p in loaded.named_parameters(remove_duplicate=False):
                assert torch.equal(p.detach(), trained[name]), f"from_pretrained: {name}"
        fresh_booster, fresh, fresh_opt = _boost(model_name, kind, precision="fp32")
        fresh_booster.load_model(fresh, path)
        fresh_booster.load_optimizer(fresh_opt, path)
        for name, value in _full(fresh).items():
            assert torch.equal(value, trained[name]), f"load_model: {name}"
        # The one format: plain Gemini over all ranks (dp 4, no tp) loads it too.
        plain_booster, plain, plain_opt = _boost(model_name, kind, tp_size=1, precision="fp32")
        plain_booster.load_model(plain, path)
        plain_booster.load_optimizer(plain_opt, path)
        # One more step each: equal only if the optimizer states (momentum) came back.
        for args in ((booster, model, optimizer), (fresh_booster, fresh, fresh_opt),
                     (plain_booster, plain, plain_opt)):
            _step(*args, STEPS, model_name)
        after, resumed, other = _full(model), _full(fresh), _full(plain)
        for name, value in after.items():
            assert torch.equal(resumed[name], value), f"resumed step: {name}"
            err = relative_error(other[name], value)  # gradients summed in another order
            assert err <= TOL, f"resumed under plain Gemini: {name} {err:.2e}"
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


@distributed_test(4)
def test_tp2_dp2_matches_one_process_and_saves_the_one_format(rank: int,
                                                              world_size: int) -> None:
    torch.set_num_threads(1)
    booster, model, optimizer = _train("gpt2_padded", "sgd", precision="fp32")
    _check_round_trip(booster, model, optimizer, "gpt2_padded", "sgd")
    _train("gpt2", "sgd", max_norm=CLIP, precision="fp32")


@distributed_test(4)
def test_tp2_extra_dp2_matches_one_process_and_saves_once(rank: int, world_size: int) -> None:
    """World 4 as tp 2 x extra_dp 2 x zero 1: each rank holds whole chunks (zero group of
    one), replicated over extra dp; clipped training equals one process (the norm counts
    each shard once: over zero and tp, not the replicas), and the checkpoint (written by
    extra-dp rank 0's tp group) loads with ``from_pretrained`` and into plain Gemini."""
    torch.set_num_threads(1)
    booster, model, optimizer = _train("gpt2", "sgd", max_norm=CLIP, extra_dp_size=2)
    plugin = booster.plugin
    assert (plugin.zero_size, plugin.extra_dp_size, plugin.dp_size) == (1, 2, 2)
    assert all(c.world_size == 1 for c in model.chunk_manager.chunks)
    path = _shared_dir()
    try:
        booster.save_model(model, path, shard=True, size_per_shard=1)
        booster.save_optimizer(optimizer, path, shard=True, size_per_shard=1)
        trained = _full(model)
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(path)
            for name, p in loaded.named_parameters(remove_duplicate=False):
                assert torch.equal(p.detach(), trained[name]), f"from_pretrained: {name}"
        plain_booster, plain, plain_opt = _boost("gpt2", "sgd", tp_size=1, precision="fp32",
                                                 max_norm=CLIP)
        plain_booster.load_model(plain, path)
        plain_booster.load_optimizer(plain_opt, path)
        for args in ((booster, model, optimizer), (plain_booster, plain, plain_opt)):
            _step(*args, STEPS, "gpt2")
        after, other = _full(model), _full(plain)
        for name, value in after.items():
            err = relative_error(other[name], value)
            assert err <= TOL, f"resumed under plain Gemini: {name} {err:.2e}"
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)


@distributed_test(2)
def test_tp2_alone_sequence_parallel_bf16_and_flags_without_tp(rank: int,
                                                              world_size: int) -> None:
    """World 2: tp 2 x dp 1 (fp32 Llama with sequence parallelism and fused norms; bf16
    GPT-2), then tp 1 x dp 2 with Shardformer's optimizations only (its fused norms in
    place, checked, so flags that are silently dropped fail)."""
    torch.set_num_threads(1)
    _train("llama", "sgd", precision="fp32", enable_sequence_parallelism=True,
           enable_fused_normalization=True)
    _train("gpt2", "adamw", precision="bf16")
    _, model, _ = _train("gpt2", "sgd", precision="fp32", tp_size=1,
                         enable_all_optimization=True)
    norm = model.unwrap().transformer.ln_f
    assert type(norm).__module__.startswith("colossal.kernels"), type(norm)
    from colossal.booster.plugin import GeminiPlugin

    with pytest.raises(ValueError, match=r"tp_size=4 does not divide the world size 2"):
        GeminiPlugin(tp_size=4)
    with pytest.raises(ValueError, match=r"tp_size=2, dp_group=.*leave dp_group None"):
        GeminiPlugin(tp_size=2, dp_group=dist.group.WORLD)
    assert not GeminiPlugin(tp_size=2, precision="fp32").support_lora()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tp_size": 0}, ValueError, r"tp_size=0 must be an int >= 1"),
        ({"extra_dp_size": 1.5}, ValueError, r"extra_dp_size=1.5 must be an int >= 1"),
        ({"enable_sequence_parallelism": True}, ValueError,
         r"enable_sequence_parallelism=True.*needs tp_size > 1, got tp_size=1"),
        ({"enable_sequence_overlap": True}, ValueError,
         r"enable_sequence_overlap=True\) needs enable_sequence_parallelism=True"),
    ],
)
def test_refused_options(kwargs: dict[str, Any], error: type, match: str) -> None:
    """Refused before any process group is needed, naming the value and the fix."""
    from colossal.booster.plugin import GeminiPlugin

    with pytest.raises(error, match=match):
        GeminiPlugin(**kwargs)
