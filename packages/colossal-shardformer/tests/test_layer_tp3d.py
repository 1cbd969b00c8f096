"""3D tensor parallel layers (tp3d) against the plain single-process model (gloo, CPU).

The world-8 checks (q = 2) run in one spawned function, as world 8 is slow on two cores:
the seed page's MLP shapes, the communication of every layer forward and backward (calls and
bytes per collective and group, against the algorithm's formula), and three tiny models
(token embedding + vocab-parallel head, token embedding + replicated head, ViT patch
embedding) whose loss, every gradient, gradient norm and parameters after SGD and AdamW steps
equal the plain model's, with the whole-tensor state dict round trip both ways.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from _tp3d_models import TokenModel, VisionModel, shard_token_model, shard_vision_model
from torch import nn

from colossal.core import CommTracker, ParallelDims, clip_grad_norm_, grad_norm, sharded_view
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import enable_full_state_dict, full_tensor
from colossal.shardformer.layer.tp3d import (
    Classifier3D,
    Cube3D,
    Dropout3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    PatchEmbedding3D,
    VocabParallelClassifier3D,
    VocabParallelEmbedding3D,
    cross_entropy_3d,
    gather_output_3d,
    split_input_3d,
    vocab_parallel_cross_entropy_3d,
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


def _groups(dims: ParallelDims, swapped: bool) -> dict[str, tuple[int, ...]]:
    """Global ranks of this rank's groups along the roles of the orientation ``swapped``."""
    cube = Cube3D(dims, swapped)
    axis = {role: cube.axis(role) for role in ("input", "weight", "output")}
    return {
        "I": tuple(dims.ranks(axis["input"])),
        "W": tuple(dims.ranks(axis["weight"])),
        "O": tuple(dims.ranks(axis["output"])),
        "IW": tuple(dims.ranks((axis["input"], axis["weight"]))),
        "WO": tuple(dims.ranks((axis["weight"], axis["output"]))),
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


# ---- the seed page's MLP ---------------------------------------------------------------------


def _check_seed_mlp(dims: ParallelDims) -> None:
    """The 3D page's MLP on 8 ranks: its printed shapes, and the plain model's output."""
    torch.manual_seed(0)
    dense_1, dense_2 = nn.Linear(256, 1024), nn.Linear(1024, 256)
    layer_1 = Linear3D.from_native_module(dense_1, dims)
    layer_2 = Linear3D.from_native_module(dense_2, dims, swapped=layer_1.output_swapped)
    # ColossalAI prints its (in, out) layout: ours is torch's (out, in), so transpose.
    assert tuple(layer_1.weight.t().shape) == (128, 256)
    assert tuple(layer_2.weight.t().shape) == (512, 64)
    x = torch.randn(16, 256)
    part = torch.chunk(x, 2, dim=0)[dims.coordinate("tp_weight")]
    part = torch.chunk(part, 2, dim=0)[dims.coordinate("tp_input")]
    part = torch.chunk(part, 2, dim=-1)[dims.coordinate("tp_output")]
    assert torch.equal(split_input_3d(x, dims), part)
    assert tuple(part.shape) == (4, 128)
    hidden = layer_1(part)
    assert tuple(hidden.shape) == (4, 512)
    out = layer_2(F.gelu(hidden))
    assert tuple(out.shape) == (4, 128)
    expected = dense_2(F.gelu(dense_1(x)))
    with pytest.raises(ValueError, match=r"this rank holds 128 of the 256 features"):
        layer_1(x)  # the whole activation instead of this rank's part
    assert_rel_close(gather_output_3d(out, dims, layer_2.output_swapped), expected, RTOL, "mlp")
    # A fresh layer: every rank holds its part of one agreed initialization.
    fresh = Linear3D(8, 16, dims=dims)
    whole = full_tensor(fresh.weight)
    first = whole.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(whole, first), "ranks built different initializations"
    assert tuple(fresh.weight.shape) == (4, 4) and fresh.bias is not None


# ---- communication per layer ------------------------------------------------------------------


def _linear_counts(
    g: dict[str, tuple[int, ...]], n: int, d_in: int, d_out: int, q: int
) -> tuple[Counts, Counts]:
    """Linear3D over ``n`` rows in all: 3 collectives each way, plus the bias all-reduce."""
    fwd = {
        ("all_gather", g["I"]): (1, n * d_in // q**2 * E),
        ("all_gather", g["W"]): (1, d_out * d_in // q**2 * E),
        ("reduce_scatter", g["O"]): (1, n * d_out // q**2 * E),
    }
    bwd = {
        ("all_gather", g["O"]): (1, n * d_out // q**2 * E),
        ("reduce_scatter", g["I"]): (1, n * d_in // q**2 * E),
        ("reduce_scatter", g["W"]): (1, d_out * d_in // q**2 * E),
        ("all_reduce", g["WO"]): (1, d_out // q * E),
    }
    return fwd, bwd


def _check_comm(dims: ParallelDims) -> None:
    """Every layer's collectives, forward and backward, equal the algorithm's exactly."""
    q, batch, seq, d, h, vocab, classes = 2, 8, 3, 8, 16, 16, 5
    n = batch * seq  # rows of the whole activation
    n_local = n // q**2
    torch.manual_seed(1)
    for swapped in (False, True):
        g = _groups(dims, swapped)
        x = split_input_3d(torch.randn(batch, seq, d), dims, swapped).requires_grad_()
        layer = Linear3D.from_native_module(nn.Linear(d, h), dims, swapped=swapped)
        assert _traced(layer, x) == _linear_counts(g, n, d, h, q), f"Linear3D {swapped}"
    g = _groups(dims, False)
    x = split_input_3d(torch.randn(batch, seq, d), dims).requires_grad_()
    head = VocabParallelClassifier3D.from_native_module(nn.Linear(d, vocab), dims)
    assert _traced(head, x) == _linear_counts(g, n, d, vocab, q), "VocabParallelClassifier3D"

    norm = LayerNorm3D.from_native_module(nn.LayerNorm(d), dims)
    assert _traced(norm, x) == (
        {("all_reduce", g["O"]): (2, 2 * n_local * E)},
        {
            ("all_reduce", g["O"]): (1, 2 * n_local * E),
            ("all_reduce", g["IW"]): (1, d // q * 2 * E),
        },
    ), "LayerNorm3D"

    ids = torch.randint(0, vocab, (batch, seq))
    emb = Embedding3D.from_native_module(nn.Embedding(vocab, d), dims)
    assert _traced(emb, ids) == ({}, {("all_reduce", g["IW"]): (1, vocab * d // q * E)})
    emb = VocabParallelEmbedding3D.from_native_module(nn.Embedding(vocab, d), dims)
    assert _traced(emb, ids) == (
        {
            ("all_gather", g["W"]): (1, vocab * d // q**2 * E),
            ("reduce_scatter", g["I"]): (1, n * d // q**2 * E),
        },
        {
            ("all_gather", g["I"]): (1, n * d // q**2 * E),
            ("reduce_scatter", g["W"]): (1, vocab * d // q**2 * E),
        },
    ), "VocabParallelEmbedding3D"

    cls = Classifier3D.from_native_module(nn.Linear(d, classes), dims)
    assert _traced(cls, x) == (
        {("all_reduce", g["O"]): (1, n_local * classes * E)},
        {("all_reduce", g["IW"]): (1, (classes * d // q + classes) * E)},
    ), "Classifier3D"

    img, patch, chans = 4, 2, 3
    pe = PatchEmbedding3D(img, patch, chans, d, dims=dims)
    params = d // q * (chans * patch * patch + 1 + 1 + (img // patch) ** 2 + 1)
    assert _traced(pe, torch.randn(batch, chans, img, img)) == (
        {},
        {("all_reduce", g["IW"]): (1, params * E)},
    ), "PatchEmbedding3D"

    targets = torch.randint(0, classes, (batch, seq))
    logits = cls(x).detach().requires_grad_()
    assert _traced(lambda t: cross_entropy_3d(t, targets, dims), logits) == (
        {("all_reduce", g["IW"]): (1, 2 * E)},
        {},
    ), "cross_entropy_3d"
    # The vocab-parallel head's logits are in the flipped orientation.
    gs = _groups(dims, True)
    logits = head(x).detach().requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq))
    assert _traced(lambda t: vocab_parallel_cross_entropy_3d(t, targets, dims, True), logits) == (
        {("all_reduce", gs["O"]): (2, 3 * n_local * E), ("all_reduce", gs["IW"]): (1, 2 * E)},
        {},
    ), "vocab_parallel_cross_entropy_3d"


# ---- models against the plain one -------------------------------------------------------------


def _compare_training(
    plain: nn.Module,
    parallel: nn.Module,
    batch: torch.Tensor,
    targets: torch.Tensor,
    loss_3d: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    name: str,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    rtol: float,
    steps: int = 3,
) -> None:
    opt_plain, opt_3d = make_opt(list(plain.parameters())), make_opt(list(parallel.parameters()))
    natives = dict(plain.named_parameters())
    assert list(dict(parallel.named_parameters())) == list(natives), name
    for step in range(steps):
        opt_plain.zero_grad()
        opt_3d.zero_grad()
        logits = plain(batch)
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss = loss_3d(parallel(batch), targets)
        assert_rel_close(loss, expected, rtol, f"{name} loss step {step}")
        expected.backward()
        loss.backward()
        if step == 0:
            for pname, p in parallel.named_parameters():
                assert_rel_close(_full_grad(p), natives[pname].grad, rtol, f"{name}.{pname}.grad")
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in plain.parameters() if p.grad is not None])
            )
            assert_rel_close(grad_norm(parallel.parameters()), norm, rtol, f"{name} grad norm")
        if step == 1:  # clipping scales by the one global norm (the updates then agree)
            clipped = clip_grad_norm_(parallel.parameters(), max_norm=0.1)
            assert_rel_close(
                clipped, nn.utils.clip_grad_norm_(plain.parameters(), 0.1), rtol, f"{name} clip"
            )
        opt_plain.step()
        opt_3d.step()
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
    loaded.load_state_dict(state)  # the 3D model's checkpoint in the plain model
    for key, value in plain.state_dict().items():
        assert_rel_close(state[key], value, RTOL, f"{name} state {key}")
    parallel.load_state_dict(other.state_dict())  # a plain checkpoint in the 3D model
    for key, value in parallel.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), f"{name} loaded {key}"
    assert_rel_close(
        gather_logits(parallel, batch, name), other(batch), RTOL, f"{name} loaded forward"
    )


def gather_logits(model: nn.Module, batch: torch.Tensor, name: str) -> torch.Tensor:
    """The whole logits of a 3D model (every class or vocab-parallel, by its head)."""
    logits = model(batch)
    head = model.head
    dims = head.cube.dims
    if isinstance(head, VocabParallelClassifier3D):
        return gather_output_3d(logits, dims, head.output_swapped)
    from colossal.shardformer.layer.tp3d import gather_batch_3d

    return gather_batch_3d(logits, dims, head.output_swapped)


def _check_models(dims: ParallelDims) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 16, (8, 3))
    ids[0, 0] = 0  # the padding id
    for vocab_parallel in (True, False):
        name = "vocab-parallel" if vocab_parallel else "replicated-head"
        loss_fn = vocab_parallel_cross_entropy_3d if vocab_parallel else cross_entropy_3d

        def loss_3d(
            logits: torch.Tensor,
            targets: torch.Tensor,
            fn: Callable[..., torch.Tensor] = loss_fn,
            swapped: bool = vocab_parallel,
        ) -> torch.Tensor:
            return fn(logits, targets, dims, swapped)

        targets = torch.randint(0, 16, (8, 3))
        for opt, rtol in (
            (lambda ps: torch.optim.SGD(ps, lr=0.5), RTOL),
            (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 1e-4),
        ):
            plain = TokenModel(16, 8, 16)
            parallel = shard_token_model(plain, dims, vocab_parallel)
            _compare_training(plain, parallel, ids, targets, loss_3d, name, opt, rtol)
        _check_state_dict(plain, parallel, TokenModel(16, 8, 16), ids, name)

    images, labels = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    plain = VisionModel(4, 2, 3, 8, 5)
    parallel = shard_vision_model(plain, dims)

    def vit_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_3d(logits, targets, dims)

    _compare_training(
        plain,
        parallel,
        images,
        labels,
        vit_loss,
        "vit",
        lambda ps: torch.optim.SGD(ps, lr=0.5),
        RTOL,
    )
    _check_state_dict(plain, parallel, VisionModel(4, 2, 3, 8, 5), images, "vit")


def _check_autocast(dims: ParallelDims) -> None:
    """bf16 autocast: the backward multiplies in the forward's precision (no dtype clash),
    and the loss and gradients stay near the plain model's under the same autocast."""
    torch.manual_seed(3)
    ids, targets = torch.randint(0, 16, (8, 3)), torch.randint(0, 16, (8, 3))
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = plain(ids)
        expected = F.cross_entropy(logits.reshape(-1, 16).float(), targets.reshape(-1))
        loss = vocab_parallel_cross_entropy_3d(parallel(ids), targets, dims, True)
    expected.backward()
    loss.backward()
    assert_rel_close(loss, expected, 2e-2, "bf16 loss")
    natives = dict(plain.named_parameters())
    for pname, p in parallel.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname
        assert_rel_close(_full_grad(p), natives[pname].grad, 5e-2, f"bf16 {pname}.grad")


def _check_dropout(dims: ParallelDims) -> None:
    """Partitioned: a different mask on each of the 8 ranks; replicated: along the output axis
    the same, across row blocks different."""
    world = dist.get_world_size()
    for partitioned in (True, False):
        drop = Dropout3D(0.5, dims=dims, partitioned=partitioned)
        mask = drop(torch.ones(64))
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask)
        for r in range(world):
            same_rows = dims.ranks("tp_output", rank=r) == dims.ranks("tp_output")
            should_match = not partitioned and same_rows
            assert torch.equal(masks[r], mask) == (should_match or r == dist.get_rank()), (
                partitioned,
                r,
            )


@distributed_test(8, timeout=600.0)
def test_tp3d_layers_match_the_plain_model(rank: int, world_size: int) -> None:
    """Catches: a wrong block of any weight, activation or bias; a missing or extra
    collective or one on the wrong group (comm counts); a replicated parameter whose gradient
    is not summed (gradients, norm); a wrong orientation flip; tied weights of mismatched
    layouts; marks that gather wrongly (state dict, norm); the seed page's shapes."""
    dims = ParallelDims(tp=8, tp_mode="3d")
    _check_seed_mlp(dims)
    _check_comm(dims)
    _check_models(dims)
    _check_autocast(dims)
    _check_dropout(dims)


@distributed_test(1)
def test_tp3d_single_rank_cube_is_the_plain_model(rank: int, world_size: int) -> None:
    """q = 1: every layer is its plain module and communicates nothing."""
    dims = ParallelDims(tp=1, tp_mode="3d")
    torch.manual_seed(0)
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    ids = torch.randint(0, 16, (4, 3))
    with CommTracker() as tracker:
        logits = parallel(ids)
        vocab_parallel_cross_entropy_3d(logits, ids, dims, True).backward()
    assert tracker.calls() == 0
    assert_rel_close(logits, plain(ids), RTOL, "q=1 logits")


# ---- validation (no processes) ---------------------------------------------------------------


def test_sizes_and_modes_are_validated() -> None:
    dims = ParallelDims(tp=8, tp_mode="3d", world_size=8)
    with pytest.raises(ValueError, match=r"out_features=6 is not divisible by q\*q=4"):
        Linear3D(8, 6, dims=dims)
    with pytest.raises(ValueError, match=r"in_features=5 is not divisible by q=2"):
        Linear3D.from_native_module(nn.Linear(5, 8), dims)
    with pytest.raises(ValueError, match=r"num_embeddings=6 is not divisible by q\*q=4"):
        VocabParallelEmbedding3D.from_native_module(nn.Embedding(6, 8), dims)
    with pytest.raises(ValueError, match=r"normalized_shape=3 is not divisible by q=2"):
        LayerNorm3D(3, dims=dims)
    with pytest.raises(ValueError, match=r"tp_mode='3d'"):
        Linear3D(8, 8, dims=ParallelDims(tp=4, tp_mode="2d", world_size=4))
    with pytest.raises(TypeError, match="takes an nn.Linear"):
        Classifier3D.from_native_module(nn.Conv1d(2, 2, 1), dims)  # type: ignore[arg-type]
