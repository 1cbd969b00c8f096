"""2.5D (Tesseract) tensor parallel layers (tp2p5d) against the plain model (gloo, CPU).

The world-8 checks (depth d = 2, q = 2) run in one spawned function, as world 8 is slow on
two cores: the seed page's MLP shapes, the communication of every layer forward and backward
(calls and bytes per collective and group, against the algorithm's formula), and three tiny
models (token embedding + vocab-parallel head, token embedding + replicated head, ViT patch
embedding) whose loss, every gradient, gradient norm, clipping and parameters after SGD and
AdamW steps equal the plain model's, with the whole-tensor state dict round trip both ways.
A world-4 job (data parallel 2 x a depth-2 grid of q = 1) checks the grid inside a larger
job, and q = d = 1 that every layer is then its plain module.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from _tp2p5d_models import TokenModel, VisionModel, shard_token_model, shard_vision_model
from torch import nn

from colossal.core import CommTracker, ParallelDims, clip_grad_norm_, grad_norm, sharded_view
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import enable_full_state_dict, full_tensor
from colossal.shardformer.layer.tp2p5d import (
    Classifier2p5D,
    Dropout2p5D,
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelEmbedding2p5D,
    cross_entropy_2p5d,
    gather_batch_2p5d,
    gather_output_2p5d,
    split_input_2p5d,
    vocab_parallel_cross_entropy_2p5d,
)

RTOL = 2e-5
E = 4  # bytes of a float32

Counts = dict[tuple[str, tuple[int, ...]], tuple[int, int]]


# ---- helpers ----------------------------------------------------------------------------------


def _counts(tracker: CommTracker) -> Counts:
    return {
        (kind, group): (stats.calls, stats.nbytes)
        for kind, groups in tracker.summary().items()
        for group, stats in groups.items()
    }


def _groups(dims: ParallelDims) -> dict[str, tuple[int, ...]]:
    """Global ranks of this rank's row (R), column (C), depth (D) and depth x column groups."""
    return {
        "R": tuple(dims.ranks("tp_row")),
        "C": tuple(dims.ranks("tp_col")),
        "D": tuple(dims.ranks("tp_dep")),
        "DC": tuple(dims.ranks(("tp_dep", "tp_col"))),
    }


def _traced(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[Counts, Counts]:
    """Communication of one forward and of its backward (seeded random output gradient)."""
    with CommTracker() as fwd:
        y = layer(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    with CommTracker() as bwd:
        y.backward(g)
    return _counts(fwd), _counts(bwd)


def _full_grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    view = sharded_view(p.grad, like=p)
    full = p.grad if view is None else view.gather()
    assert full is not None
    return full


def _gather_logits(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The whole logits of a 2.5D model (every class or vocab-parallel, by its head)."""
    logits = model(batch)
    dims = model.head.grid.dims
    if isinstance(model.head, VocabParallelClassifier2p5D):
        return gather_output_2p5d(logits, dims)
    return gather_batch_2p5d(logits, dims)


# ---- the seed page's MLP ---------------------------------------------------------------------


def _check_seed_mlp(dims: ParallelDims) -> None:
    """The 2.5D page's MLP on 8 ranks: its printed shapes, and the plain model's output."""
    torch.manual_seed(0)
    dense_1, dense_2 = nn.Linear(256, 1024), nn.Linear(1024, 256)
    layer_1 = Linear2p5D.from_native_module(dense_1, dims)
    layer_2 = Linear2p5D.from_native_module(dense_2, dims)
    # ColossalAI prints its (in, out) layout: ours is torch's (out, in), so transpose.
    assert tuple(layer_1.weight.t().shape) == (128, 512)
    assert tuple(layer_2.weight.t().shape) == (512, 128)
    x = torch.randn(16, 256)
    part = torch.chunk(x, 2, dim=0)[dims.coordinate("tp_dep")]
    part = torch.chunk(part, 2, dim=0)[dims.coordinate("tp_col")]
    part = torch.chunk(part, 2, dim=-1)[dims.coordinate("tp_row")]
    assert torch.equal(split_input_2p5d(x, dims), part)
    assert tuple(part.shape) == (4, 128)
    hidden = layer_1(part)
    assert tuple(hidden.shape) == (4, 512)
    out = layer_2(F.gelu(hidden))
    assert tuple(out.shape) == (4, 128)
    expected = dense_2(F.gelu(dense_1(x)))
    with pytest.raises(ValueError, match=r"this rank holds 128 of the 256 features"):
        layer_1(x)  # the whole activation instead of this rank's part
    assert_rel_close(gather_output_2p5d(out, dims), expected, RTOL, "mlp")
    # A fresh layer: every rank holds its part of one agreed initialization.
    fresh = Linear2p5D(8, 16, dims=dims)
    whole = full_tensor(fresh.weight)
    first = whole.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(whole, first), "ranks built different initializations"
    assert tuple(fresh.weight.shape) == (8, 4) and fresh.bias is not None


# ---- communication per layer ------------------------------------------------------------------


def _linear_counts(
    g: dict[str, tuple[int, ...]], n: int, d_in: int, d_out: int, d: int, q: int
) -> tuple[Counts, Counts]:
    """Linear2p5D over ``n`` rows in all: 2 gathers forward; 2 gathers, 2 reduce-scatters,
    the weight gradient's depth all-reduce and the bias gradient's all-reduce backward."""
    x_row = n // (d * q) * d_in * E  # this rank's rows, every input column
    w_col = d_out // q * d_in * E  # this rank's output columns, every input row
    fwd = {("all_gather", g["R"]): (1, x_row), ("all_gather", g["C"]): (1, w_col)}
    bwd = {
        ("all_gather", g["C"]): (1, w_col),
        ("reduce_scatter", g["R"]): (1, x_row),
        ("all_gather", g["R"]): (1, x_row),
        ("reduce_scatter", g["C"]): (1, w_col),
        ("all_reduce", g["D"]): (1, d_out * d_in // q**2 * E),
        ("all_reduce", g["DC"]): (1, d_out // q * E),
    }
    return fwd, bwd


def _check_comm(dims: ParallelDims) -> None:
    """Every layer's collectives, forward and backward, equal the algorithm's exactly."""
    d, q, batch, seq, h, hid, vocab, classes = 2, 2, 8, 3, 8, 16, 16, 5
    n = batch * seq  # rows of the whole activation
    n_local = n // (d * q)
    g = _groups(dims)
    torch.manual_seed(1)
    x = split_input_2p5d(torch.randn(batch, seq, h), dims).requires_grad_()
    layer = Linear2p5D.from_native_module(nn.Linear(h, hid), dims)
    assert _traced(layer, x) == _linear_counts(g, n, h, hid, d, q), "Linear2p5D"

    head = VocabParallelClassifier2p5D.from_native_module(nn.Linear(h, vocab), dims)
    assert _traced(head, x) == (
        {
            ("all_gather", g["C"]): (1, vocab * h // q * E),
            ("reduce_scatter", g["R"]): (1, n_local * vocab * E),
        },
        {
            ("all_gather", g["R"]): (1, n_local * vocab * E),
            ("all_gather", g["C"]): (1, vocab * h // q * E),
            ("reduce_scatter", g["C"]): (1, vocab * h // q * E),
            ("all_reduce", g["D"]): (1, vocab * h // q**2 * E),
            ("all_reduce", g["DC"]): (1, vocab // q * E),
        },
    ), "VocabParallelClassifier2p5D"

    norm = LayerNorm2p5D.from_native_module(nn.LayerNorm(h), dims)
    assert _traced(norm, x) == (
        {("all_reduce", g["R"]): (2, 2 * n_local * E)},
        {
            ("all_reduce", g["R"]): (1, 2 * n_local * E),
            ("all_reduce", g["DC"]): (1, h // q * 2 * E),
        },
    ), "LayerNorm2p5D"

    ids = torch.randint(0, vocab, (batch, seq))
    emb = Embedding2p5D.from_native_module(nn.Embedding(vocab, h), dims)
    assert _traced(emb, ids) == ({}, {("all_reduce", g["DC"]): (1, vocab * h // q * E)})
    emb = VocabParallelEmbedding2p5D.from_native_module(nn.Embedding(vocab, h), dims)
    layer_rows = n // d * h // q * E  # the rows of this rank's layer, its columns
    assert _traced(emb, ids) == (
        {("reduce_scatter", g["C"]): (1, layer_rows)},
        {
            ("all_gather", g["C"]): (1, layer_rows),
            ("all_reduce", g["D"]): (1, vocab * h // q**2 * E),
        },
    ), "VocabParallelEmbedding2p5D"

    cls = Classifier2p5D.from_native_module(nn.Linear(h, classes), dims)
    assert _traced(cls, x) == (
        {("all_reduce", g["R"]): (1, n_local * classes * E)},
        {("all_reduce", g["DC"]): (1, (classes * h // q + classes) * E)},
    ), "Classifier2p5D"

    img, patch, chans = 4, 2, 3
    pe = PatchEmbedding2p5D(img, patch, chans, h, dims=dims)
    params = h // q * (chans * patch * patch + 1 + 1 + (img // patch) ** 2 + 1)
    assert _traced(pe, torch.randn(batch, chans, img, img)) == (
        {},
        {("all_reduce", g["DC"]): (1, params * E)},
    ), "PatchEmbedding2p5D"

    targets = torch.randint(0, classes, (batch, seq))
    logits = cls(x).detach().requires_grad_()
    assert _traced(lambda t: cross_entropy_2p5d(t, targets, dims), logits) == (
        {("all_reduce", g["DC"]): (1, 2 * E)},
        {},
    ), "cross_entropy_2p5d"
    logits = head(x).detach().requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq))
    assert _traced(lambda t: vocab_parallel_cross_entropy_2p5d(t, targets, dims), logits) == (
        {("all_reduce", g["R"]): (2, 3 * n_local * E), ("all_reduce", g["DC"]): (1, 2 * E)},
        {},
    ), "vocab_parallel_cross_entropy_2p5d"


# ---- models against the plain one -------------------------------------------------------------


def _compare_training(
    plain: nn.Module,
    parallel: nn.Module,
    batch: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    name: str,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    rtol: float,
    group: dist.ProcessGroup,
    steps: int = 3,
) -> None:
    """Loss, gradients, norm and clipping (over ``group``, the model's ranks), and the
    parameters after ``steps`` steps, equal the plain model's."""
    opt_plain, opt_par = make_opt(list(plain.parameters())), make_opt(list(parallel.parameters()))
    natives = dict(plain.named_parameters())
    assert list(dict(parallel.named_parameters())) == list(natives), name
    for step in range(steps):
        opt_plain.zero_grad()
        opt_par.zero_grad()
        logits = plain(batch)
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss = loss_fn(parallel(batch), targets)
        assert_rel_close(loss, expected, rtol, f"{name} loss step {step}")
        expected.backward()
        loss.backward()
        if step == 0:
            for pname, p in parallel.named_parameters():
                assert_rel_close(_full_grad(p), natives[pname].grad, rtol, f"{name}.{pname}.grad")
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None])
            )
            assert_rel_close(
                grad_norm(parallel.parameters(), group=group), norm, rtol, f"{name} grad norm"
            )
        if step == 1:  # clipping scales by the one global norm (the updates then agree)
            clipped = clip_grad_norm_(parallel.parameters(), max_norm=0.1, group=group)
            assert_rel_close(
                clipped, nn.utils.clip_grad_norm_(plain.parameters(), 0.1), rtol, f"{name} clip"
            )
        opt_plain.step()
        opt_par.step()
    for pname, p in parallel.named_parameters():
        assert_rel_close(full_tensor(p), natives[pname], rtol, f"{name}.{pname} after steps")


def _check_state_dict(
    plain: nn.Module, parallel: nn.Module, other: nn.Module, batch: torch.Tensor, name: str
) -> None:
    """Whole tensors out (the plain model loads them), a plain state dict in (each part)."""
    enable_full_state_dict(parallel)
    state = parallel.state_dict()
    assert state.keys() == plain.state_dict().keys(), name
    loaded = copy.deepcopy(other)
    loaded.load_state_dict(state)  # the 2.5D model's checkpoint in the plain model
    for key, value in plain.state_dict().items():
        assert_rel_close(state[key], value, RTOL, f"{name} state {key}")
    parallel.load_state_dict(other.state_dict())  # a plain checkpoint in the 2.5D model
    for key, value in parallel.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), f"{name} loaded {key}"
    assert_rel_close(_gather_logits(parallel, batch), other(batch), RTOL, f"{name} loaded fwd")


def _check_token_models(dims: ParallelDims, adamw: bool = True) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 16, (8, 3))
    ids[0, 0] = 0  # the padding id
    targets = torch.randint(0, 16, (8, 3))
    optimizers = [(lambda ps: torch.optim.SGD(ps, lr=0.5), RTOL)]
    if adamw:
        optimizers.append((lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 1e-4))
    for vocab_parallel in (True, False):
        name = "vocab-parallel" if vocab_parallel else "replicated-head"
        fn = vocab_parallel_cross_entropy_2p5d if vocab_parallel else cross_entropy_2p5d

        def loss_fn(
            logits: torch.Tensor, t: torch.Tensor, fn: Callable[..., torch.Tensor] = fn
        ) -> torch.Tensor:
            return fn(logits, t, dims)

        for make_opt, rtol in optimizers:
            plain = TokenModel(16, 8, 16)
            parallel = shard_token_model(plain, dims, vocab_parallel)
            _compare_training(
                plain, parallel, ids, targets, loss_fn, name, make_opt, rtol, dims.group("tp")
            )
        _check_state_dict(plain, parallel, TokenModel(16, 8, 16), ids, name)


def _check_vision_model(dims: ParallelDims) -> None:
    torch.manual_seed(3)
    images, labels = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    plain = VisionModel(4, 2, 3, 8, 5)
    parallel = shard_vision_model(plain, dims)

    def vit_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_2p5d(logits, targets, dims)

    _compare_training(
        plain,
        parallel,
        images,
        labels,
        vit_loss,
        "vit",
        lambda ps: torch.optim.SGD(ps, lr=0.5),
        RTOL,
        dims.group("tp"),
    )
    _check_state_dict(plain, parallel, VisionModel(4, 2, 3, 8, 5), images, "vit")


def _check_autocast(dims: ParallelDims) -> None:
    """bf16 autocast: the backward multiplies in the forward's precision (no dtype clash),
    and the loss and gradients stay near the plain model's under the same autocast."""
    torch.manual_seed(4)
    ids, targets = torch.randint(0, 16, (8, 3)), torch.randint(0, 16, (8, 3))
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = plain(ids)
        expected = F.cross_entropy(logits.reshape(-1, 16).float(), targets.reshape(-1))
        loss = vocab_parallel_cross_entropy_2p5d(parallel(ids), targets, dims)
    expected.backward()
    loss.backward()
    assert_rel_close(loss, expected, 2e-2, "bf16 loss")
    natives = dict(plain.named_parameters())
    for pname, p in parallel.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname
        assert_rel_close(_full_grad(p), natives[pname].grad, 5e-2, f"bf16 {pname}.grad")


def _check_dropout(dims: ParallelDims) -> None:
    """Partitioned: a different mask on each of the 8 ranks; replicated: the same along a
    row group, different across row blocks."""
    world = dist.get_world_size()
    for partitioned in (True, False):
        drop = Dropout2p5D(0.5, dims=dims, partitioned=partitioned)
        mask = drop(torch.ones(64))
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask)
        row = dims.ranks("tp_row")
        for r in range(world):
            should_match = r == dist.get_rank() or (not partitioned and r in row)
            assert torch.equal(masks[r], mask) == should_match, (partitioned, r)


@distributed_test(8, timeout=600.0)
def test_tp2p5d_layers_match_the_plain_model(rank: int, world_size: int) -> None:
    """Catches: a wrong block of any weight, activation or bias; a missing or extra
    collective or one on the wrong group (comm counts); a gradient not summed over the depth
    or over the replicas (gradients, norm); tied weights of mismatched layouts; marks that
    gather wrongly (state dict, norm); the seed page's shapes."""
    dims = ParallelDims(tp=8, tp_mode="2.5d", tp_depth=2)
    assert dims.tp_grid_shape == (2, 2, 2)
    _check_seed_mlp(dims)
    _check_comm(dims)
    _check_token_models(dims)
    _check_vision_model(dims)
    _check_autocast(dims)
    _check_dropout(dims)


@distributed_test(4, timeout=300.0)
def test_tp2p5d_depth_only_grid_inside_data_parallel(rank: int, world_size: int) -> None:
    """dp 2 x a 2.5D grid of depth 2 and q = 1: rows split over the depth only, weights
    replicated there (their gradients summed over it), each data-parallel replica alone."""
    dims = ParallelDims(dp=2, tp=2, tp_mode="2.5d", tp_depth=2)
    assert dims.tp_grid_shape == (2, 1, 1)
    _check_token_models(dims, adamw=False)


@distributed_test(1)
def test_tp2p5d_single_rank_grid_is_the_plain_model(rank: int, world_size: int) -> None:
    """d = q = 1: every layer is its plain module and communicates nothing."""
    dims = ParallelDims(tp=1, tp_mode="2.5d")
    torch.manual_seed(0)
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    ids = torch.randint(0, 16, (4, 3))
    with CommTracker() as tracker:
        logits = parallel(ids)
        vocab_parallel_cross_entropy_2p5d(logits, ids, dims).backward()
    assert tracker.calls() == 0
    assert_rel_close(logits, plain(ids), RTOL, "d=q=1 logits")


# ---- validation (no processes) ---------------------------------------------------------------


def test_sizes_and_modes_are_validated() -> None:
    dims = ParallelDims(tp=8, tp_mode="2.5d", tp_depth=2, world_size=8)
    with pytest.raises(ValueError, match=r"out_features=5 is not divisible by 2 .*d=2, side q=2"):
        Linear2p5D(8, 5, dims=dims)
    with pytest.raises(ValueError, match=r"in_features=5 is not divisible by 2"):
        Linear2p5D.from_native_module(nn.Linear(5, 8), dims)
    with pytest.raises(ValueError, match=r"num_embeddings=7 is not divisible by 2"):
        VocabParallelEmbedding2p5D.from_native_module(nn.Embedding(7, 8), dims)
    with pytest.raises(ValueError, match=r"normalized_shape=3 is not divisible by 2"):
        LayerNorm2p5D(3, dims=dims)
    with pytest.raises(ValueError, match=r"tp_mode='2.5d'"):
        Linear2p5D(8, 8, dims=ParallelDims(tp=8, tp_mode="3d", world_size=8))
    with pytest.raises(TypeError, match="takes an nn.Linear"):
        Classifier2p5D.from_native_module(nn.Conv1d(2, 2, 1), dims)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"p must lie in \[0, 1\]"):
        Dropout2p5D(1.5, dims=dims)
