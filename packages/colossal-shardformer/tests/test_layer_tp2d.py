"""2D tensor parallel layers (tp2d, SUMMA) against the plain single-process model (gloo, CPU).

At world 4 (q = 2): the seed page's MLP shapes; the communication of every layer forward and
backward (calls and bytes per collective and group, against the algorithm's formula); and
three tiny models (token embedding + vocab-parallel head, token embedding + replicated head,
ViT patch embedding) whose loss, every gradient, gradient norm, clipping and parameters after
SGD and AdamW steps equal the plain model's, with the whole-tensor state dict round trip both
ways.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from _tp2d_models import (
    TokenModel,
    VisionModel,
    gather_logits,
    shard_token_model,
    shard_vision_model,
)
from torch import nn

from colossal.core import CommTracker, ParallelDims, clip_grad_norm_, grad_norm, sharded_view
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import enable_full_state_dict, full_tensor
from colossal.shardformer.layer.tp2d import (
    Classifier2D,
    Dropout2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelEmbedding2D,
    cross_entropy_2d,
    gather_output_2d,
    split_input_2d,
    vocab_parallel_cross_entropy_2d,
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
    """The 2D page's MLP on 4 ranks: its printed shapes, and the plain model's output."""
    torch.manual_seed(0)
    dense_1, dense_2 = nn.Linear(256, 1024), nn.Linear(1024, 256)
    layer_1 = Linear2D.from_native_module(dense_1, dims)
    layer_2 = Linear2D.from_native_module(dense_2, dims)
    # ColossalAI prints its (in, out) layout: ours is torch's (out, in), so transpose.
    assert tuple(layer_1.weight.t().shape) == (128, 512)
    assert tuple(layer_2.weight.t().shape) == (512, 128)
    x = torch.randn(16, 256)
    part = torch.chunk(x, 2, dim=0)[dims.coordinate("tp_col")]  # PARALLEL_2D_COL's rank
    part = torch.chunk(part, 2, dim=-1)[dims.coordinate("tp_row")]  # PARALLEL_2D_ROW's rank
    assert torch.equal(split_input_2d(x, dims), part)
    assert tuple(part.shape) == (8, 128)
    hidden = layer_1(part)
    assert tuple(hidden.shape) == (8, 512)
    out = layer_2(F.gelu(hidden))
    assert tuple(out.shape) == (8, 128)
    expected = dense_2(F.gelu(dense_1(x)))
    assert_rel_close(gather_output_2d(out, dims), expected, RTOL, "mlp")
    # Backward through split and gather: the input's and every parameter's gradient.
    x_plain, x_2d = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(16, 256)
    dense_2(F.gelu(dense_1(x_plain))).backward(g)
    y = layer_2(F.gelu(layer_1(split_input_2d(x_2d, dims))))
    gather_output_2d(y, dims).backward(g)
    assert_rel_close(x_2d.grad, x_plain.grad, RTOL, "mlp input grad")
    for layer, dense in ((layer_1, dense_1), (layer_2, dense_2)):
        for pname in ("weight", "bias"):
            got, want = _full_grad(getattr(layer, pname)), getattr(dense, pname).grad
            assert_rel_close(got, want, RTOL, f"mlp {pname} grad")
    with pytest.raises(ValueError, match=r"this rank holds 128 of the 256 features"):
        layer_1(x)  # the whole activation instead of this rank's block
    # A fresh layer: every rank holds its part of one agreed initialization.
    fresh = Linear2D(8, 16, dims=dims)
    whole = full_tensor(fresh.weight)
    first = whole.clone()
    dist.broadcast(first, src=0)
    assert torch.equal(whole, first), "ranks built different initializations"
    assert tuple(fresh.weight.shape) == (8, 4) and fresh.bias is not None
    assert tuple(fresh.bias.shape) == (4,)


# ---- communication per layer ------------------------------------------------------------------


def _check_comm(dims: ParallelDims) -> None:
    """Every layer's collectives, forward and backward, equal the algorithm's exactly."""
    q, batch, seq, d, h, vocab, classes = 2, 8, 3, 8, 16, 16, 5
    n = batch * seq  # rows of the whole activation
    n_local = n // q
    rows, cols = tuple(dims.ranks("tp_row")), tuple(dims.ranks("tp_col"))
    torch.manual_seed(1)
    x = split_input_2d(torch.randn(batch, seq, d), dims).requires_grad_()

    # Linear2D: SUMMA, q steps of each of the six phases, plus the bias gather/scatter.
    layer = Linear2D.from_native_module(nn.Linear(d, h), dims)
    act, wgt = n * d * E // q, d * h * E // q
    assert _traced(layer, x) == (
        {
            ("broadcast", rows): (q, act),
            ("broadcast", cols): (q, wgt),
            ("all_gather", cols): (1, h * E // q),
        },
        {
            ("broadcast", cols): (q, wgt),
            ("reduce", rows): (q, act),
            ("broadcast", rows): (q, act),
            ("reduce", cols): (q, wgt),
            ("reduce_scatter", cols): (1, h * E // q),
        },
    ), "Linear2D"

    head = VocabParallelClassifier2D.from_native_module(nn.Linear(d, vocab), dims)
    logits_bytes, wgt = n * vocab * E // q, d * vocab * E // q
    assert _traced(head, x) == (
        {
            ("broadcast", cols): (q, wgt),
            ("reduce", rows): (q, logits_bytes),
            ("all_gather", cols): (1, vocab * E // q),
        },
        {
            ("broadcast", rows): (q, logits_bytes),
            ("broadcast", cols): (q, wgt),
            ("reduce", cols): (q, wgt),
            ("reduce_scatter", cols): (1, vocab * E // q),
        },
    ), "VocabParallelClassifier2D"

    norm = LayerNorm2D.from_native_module(nn.LayerNorm(d), dims)
    assert _traced(norm, x) == (
        {("all_reduce", rows): (2, 2 * n_local * E), ("all_gather", cols): (1, 2 * d * E // q)},
        {
            ("all_reduce", rows): (1, 2 * n_local * E),
            ("reduce_scatter", cols): (1, 2 * d * E // q),
        },
    ), "LayerNorm2D"

    ids = torch.randint(0, vocab, (batch, seq))
    emb = Embedding2D.from_native_module(nn.Embedding(vocab, d), dims)
    assert _traced(emb, ids) == (
        {("all_gather", cols): (1, vocab * d * E // q)},
        {("reduce_scatter", cols): (1, vocab * d * E // q)},
    ), "Embedding2D"
    emb = VocabParallelEmbedding2D.from_native_module(nn.Embedding(vocab, d), dims)
    assert _traced(emb, ids) == (
        {("reduce_scatter", cols): (1, n * d * E // q)},
        {("all_gather", cols): (1, n * d * E // q)},
    ), "VocabParallelEmbedding2D"

    cls = Classifier2D.from_native_module(nn.Linear(d, classes), dims)
    assert _traced(cls, x) == (
        {
            ("all_gather", cols): (1, classes * d * E // q),
            ("all_reduce", rows): (1, n_local * classes * E),
        },
        {
            ("reduce_scatter", cols): (1, classes * d * E // q),
            ("all_reduce", cols): (1, classes * E),
        },
    ), "Classifier2D"

    img, patch, chans = 4, 2, 3
    pe = PatchEmbedding2D(img, patch, chans, d, dims=dims)
    params = d * (chans * patch * patch + 1 + 1 + (img // patch) ** 2 + 1)
    assert _traced(pe, torch.randn(batch, chans, img, img)) == (
        {("all_gather", cols): (1, params * E // q)},
        {("reduce_scatter", cols): (1, params * E // q)},
    ), "PatchEmbedding2D"

    targets = torch.randint(0, classes, (batch, seq))
    logits = cls(x).detach().requires_grad_()
    assert _traced(lambda t: cross_entropy_2d(t, targets, dims), logits) == (
        {("all_reduce", cols): (1, 2 * E)},
        {},
    ), "cross_entropy_2d"
    logits = head(x).detach().requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq))
    assert _traced(lambda t: vocab_parallel_cross_entropy_2d(t, targets, dims), logits) == (
        {("all_reduce", rows): (2, 3 * n_local * E), ("all_reduce", cols): (1, 2 * E)},
        {},
    ), "vocab_parallel_cross_entropy_2d"


# ---- models against the plain one -------------------------------------------------------------


def _compare_training(
    plain: nn.Module,
    parallel: nn.Module,
    batch: torch.Tensor,
    targets: torch.Tensor,
    loss_2d: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    name: str,
    make_opt: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    rtol: float,
    steps: int = 3,
) -> None:
    opt_plain, opt_2d = make_opt(list(plain.parameters())), make_opt(list(parallel.parameters()))
    natives = dict(plain.named_parameters())
    assert list(dict(parallel.named_parameters())) == list(natives), name
    for step in range(steps):
        opt_plain.zero_grad()
        opt_2d.zero_grad()
        logits = plain(batch)
        expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss = loss_2d(parallel(batch), targets)
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
        opt_2d.step()
    for pname, p in parallel.named_parameters():
        assert_rel_close(full_tensor(p), natives[pname], rtol, f"{name}.{pname} after steps")


def _check_state_dict(
    plain: nn.Module, parallel: nn.Module, other: nn.Module, batch: torch.Tensor, name: str
) -> None:
    """Whole tensors out (the plain model loads them), a plain state dict in (each part)."""
    enable_full_state_dict(parallel)
    state = parallel.state_dict()
    assert state.keys() == plain.state_dict().keys(), name
    for key, value in plain.state_dict().items():
        assert_rel_close(state[key], value, RTOL, f"{name} state {key}")
    loaded = copy.deepcopy(other)
    loaded.load_state_dict(state)  # the 2D model's checkpoint in the plain model
    assert_rel_close(loaded(batch), plain(batch), RTOL, f"{name} plain loads 2D")
    parallel.load_state_dict(other.state_dict())  # a plain checkpoint in the 2D model
    for key, value in parallel.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), f"{name} loaded {key}"
    assert_rel_close(gather_logits(parallel, batch), other(batch), RTOL, f"{name} 2D loads plain")


def _check_models(dims: ParallelDims) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 16, (8, 3))
    ids[0, 0] = 0  # the padding id
    for vocab_parallel in (True, False):
        name = "vocab-parallel" if vocab_parallel else "replicated-head"
        loss_fn = vocab_parallel_cross_entropy_2d if vocab_parallel else cross_entropy_2d

        def loss_2d(
            logits: torch.Tensor,
            targets: torch.Tensor,
            fn: Callable[..., torch.Tensor] = loss_fn,
        ) -> torch.Tensor:
            return fn(logits, targets, dims)

        targets = torch.randint(0, 16, (8, 3))
        for opt, rtol in (
            (lambda ps: torch.optim.SGD(ps, lr=0.5), RTOL),
            (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 1e-4),
        ):
            plain = TokenModel(16, 8, 16)
            parallel = shard_token_model(plain, dims, vocab_parallel)
            _compare_training(plain, parallel, ids, targets, loss_2d, name, opt, rtol)
        _check_state_dict(plain, parallel, TokenModel(16, 8, 16), ids, name)

    images, labels = torch.randn(8, 3, 4, 4), torch.randint(0, 5, (8,))
    plain = VisionModel(4, 2, 3, 8, 5)
    parallel = shard_vision_model(plain, dims)

    def vit_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_2d(logits, targets, dims)

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


def _check_dropout(dims: ParallelDims) -> None:
    """Partitioned: a different mask on each rank; replicated: the same along a row only."""
    world = dist.get_world_size()
    for partitioned in (True, False):
        drop = Dropout2D(0.5, dims=dims, partitioned=partitioned)
        mask = drop(torch.ones(64))
        masks = [torch.empty_like(mask) for _ in range(world)]
        dist.all_gather(masks, mask)
        for r in range(world):
            same_row = r in dims.ranks("tp_row")
            should_match = r == dist.get_rank() or (not partitioned and same_row)
            assert torch.equal(masks[r], mask) == should_match, (partitioned, r)


@distributed_test(4, timeout=600.0)
def test_tp2d_layers_match_the_plain_model(rank: int, world_size: int) -> None:
    """Catches: a wrong block of any weight, activation or bias; a SUMMA step on the wrong
    source or target (outputs, gradients); a missing, extra or misplaced collective (comm
    counts); a replicated parameter whose gradient is not summed (gradients, norm); tied
    weights of mismatched layouts; marks that gather wrongly (state dict, norm); the seed
    page's shapes; the dropout seeding rule."""
    dims = ParallelDims(tp=4, tp_mode="2d")
    _check_seed_mlp(dims)
    _check_comm(dims)
    _check_models(dims)
    _check_dropout(dims)


@distributed_test(8, timeout=600.0)
def test_tp2d_grids_per_data_parallel_replica(rank: int, world_size: int) -> None:
    """dp=2 x a 2x2 grid: each replica's SUMMA stays inside its own grid (groups, sources
    and targets are that replica's global ranks); loss, gradients and norm match the plain
    model on the replica's own batch, and so does the norm over the replica's grid."""
    dims = ParallelDims(dp=2, tp=4, tp_mode="2d")
    replica = dims.coordinate("dp")
    grid_ranks = set(dims.ranks("tp"))
    assert grid_ranks == set(range(4 * replica, 4 * replica + 4))
    torch.manual_seed(3)
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    batches = torch.randint(0, 16, (2, 4, 3))
    ids, targets = batches[replica], batches[1 - replica]
    with CommTracker() as tracker:
        loss = vocab_parallel_cross_entropy_2d(parallel(ids), targets, dims)
        loss.backward()
    assert all(
        set(group) <= grid_ranks for groups in tracker.summary().values() for group in groups
    )
    logits = plain(ids)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    expected.backward()
    assert_rel_close(loss, expected, RTOL, f"replica {replica} loss")
    natives = dict(plain.named_parameters())
    for pname, p in parallel.named_parameters():
        assert_rel_close(_full_grad(p), natives[pname].grad, RTOL, f"replica {replica} {pname}")
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()]))
    # The norm of one replica's model: over the ranks holding it (grad_norm's ``group``).
    got = grad_norm(parallel.parameters(), group=dims.group("tp"))
    assert_rel_close(got, norm, RTOL, "grad norm per replica")


@distributed_test(1)
def test_tp2d_single_rank_grid_is_the_plain_model(rank: int, world_size: int) -> None:
    """q = 1: every layer is its plain module and communicates nothing."""
    dims = ParallelDims(tp=1, tp_mode="2d")
    torch.manual_seed(0)
    plain = TokenModel(16, 8, 16)
    parallel = shard_token_model(plain, dims, vocab_parallel=True)
    ids = torch.randint(0, 16, (4, 3))
    with CommTracker() as tracker:
        logits = parallel(ids)
        vocab_parallel_cross_entropy_2d(logits, ids, dims).backward()
    assert tracker.calls() == 0
    assert_rel_close(logits, plain(ids), RTOL, "q=1 logits")


# ---- validation (no processes) ---------------------------------------------------------------


def test_sizes_and_modes_are_validated() -> None:
    dims = ParallelDims(tp=4, tp_mode="2d", world_size=4)
    with pytest.raises(ValueError, match=r"out_features=6 is not divisible by q\*q=4"):
        Linear2D(8, 6, dims=dims)  # the bias is split q*q ways
    with pytest.raises(ValueError, match=r"in_features=5 is not divisible by q=2"):
        Linear2D.from_native_module(nn.Linear(5, 8), dims)
    with pytest.raises(ValueError, match=r"num_embeddings=5 is not divisible by q=2"):
        VocabParallelEmbedding2D.from_native_module(nn.Embedding(5, 8), dims)
    with pytest.raises(ValueError, match=r"normalized_shape=6 is not divisible by q\*q=4"):
        LayerNorm2D(6, dims=dims)
    with pytest.raises(ValueError, match=r"tp_mode='2d'"):
        Linear2D(8, 8, dims=ParallelDims(tp=8, tp_mode="3d", world_size=8))
    with pytest.raises(TypeError, match="takes an nn.Linear"):
        Classifier2D.from_native_module(nn.Conv1d(2, 2, 1), dims)  # type: ignore[arg-type]
