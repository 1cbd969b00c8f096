"""Column/row-parallel linear layers against the native single-process modules (gloo, CPU).

Every rank builds the native module from one seed, shards a copy, and compares outputs, input
gradients and every parameter gradient (gathered through ``sharded_view``) at rel. error 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import Block, CommTracker, shard_spec, sharded_view
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import (
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
    enter_tp_region,
)
from colossal.shardformer.layer.linear import column_part

RTOL = 1e-5


def _grads_match(native: nn.Module, parallel: nn.Module, name: str) -> None:
    natives = dict(native.named_parameters())
    for pname, p in parallel.named_parameters():
        view = sharded_view(p.grad, like=p)
        full = p.grad if view is None else view.gather()
        assert_rel_close(full, natives[pname].grad, RTOL, f"{name}.{pname}.grad")


def _check_column(cls: type, native: nn.Module, gather: bool, n_fused: int, in_f: int) -> None:
    tp, rank = dist.get_world_size(), dist.get_rank()
    layer = cls.from_native_module(
        copy.deepcopy(native), None, gather_output=gather, n_fused=n_fused
    )
    name = f"{cls.__name__}(gather={gather}, n_fused={n_fused})"
    assert list(dict(layer.named_parameters())) == list(dict(native.named_parameters())), name
    x = torch.randn(3, 5, in_f)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = native(x_ref)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y = layer(x_tp)
    if gather:
        expected, g_local = y_ref, g
    else:
        part = column_part(tuple(y_ref.shape), y_ref.dim() - 1, n_fused, tp, rank)
        expected, g_local = part.take(y_ref), part.take(g)
    assert_rel_close(y, expected, RTOL, f"{name} output")
    y.backward(g_local)
    assert_rel_close(x_tp.grad, x_ref.grad, RTOL, f"{name} input grad")
    _grads_match(native, layer, name)


def _check_row(cls: type, native: nn.Module, parallel_input: bool, in_f: int) -> None:
    tp, rank = dist.get_world_size(), dist.get_rank()
    layer = cls.from_native_module(copy.deepcopy(native), None, parallel_input=parallel_input)
    name = f"{cls.__name__}(parallel_input={parallel_input})"
    assert shard_spec(layer.bias) is None, "a row-parallel bias is replicated (unmarked)"
    x = torch.randn(3, 5, in_f)
    x_ref = x.clone().requires_grad_()
    y_ref = native(x_ref)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    per = in_f // tp
    cols = Block.along(tuple(x.shape), 2, rank * per, (rank + 1) * per)
    x_tp = (cols.take(x) if parallel_input else x).clone().requires_grad_()
    y = layer(x_tp)
    assert_rel_close(y, y_ref, RTOL, f"{name} output")
    y.backward(g)
    expected = cols.take(x_ref.grad) if parallel_input else x_ref.grad
    assert_rel_close(x_tp.grad, expected, RTOL, f"{name} input grad")
    _grads_match(native, layer, name)


class _Attn(nn.Module):
    """q/k/v column projections reading the same input, then a row projection."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)
        return self.o(q * k + v)


@distributed_test(2, 4)
def test_linear_layers_match_native(rank: int, world_size: int) -> None:
    """Catches: wrong shard offsets (fused q/k/v), a missing/extra grad all-reduce, a bias
    added before the all-reduce (tp x bias), a mis-ordered gather of fused outputs, bad marks."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    d = 8
    for gather in (False, True):
        _check_column(Linear1D_Col, nn.Linear(d, 24), gather, 1, d)
        _check_column(Linear1D_Col, nn.Linear(d, 24), gather, 3, d)
        _check_column(GPT2FusedLinearConv1D_Col, Conv1D(24, d), gather, 3, d)
    _check_column(Linear1D_Col, nn.Linear(d, 12, bias=False), False, 1, d)
    for parallel_input in (True, False):
        _check_row(Linear1D_Row, nn.Linear(16, d), parallel_input, 16)
        _check_row(GPT2FusedLinearConv1D_Row, Conv1D(d, 16), parallel_input, 16)

    # Megatron's count: a col -> row MLP costs one all-reduce forward and one backward.
    mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
    ref = copy.deepcopy(mlp)
    mlp[0] = Linear1D_Col.from_native_module(mlp[0], None)
    mlp[2] = Linear1D_Row.from_native_module(mlp[2], None)
    x = torch.randn(2, 3, d, requires_grad=True)
    with CommTracker() as fwd:
        y = mlp(x)
    with CommTracker() as bwd:
        y.sum().backward()
    assert (fwd.calls("all_reduce"), fwd.calls()) == (1, 1), fwd.table()
    assert (bwd.calls("all_reduce"), bwd.calls()) == (1, 1), bwd.table()
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    assert_rel_close(x.grad, x_ref.grad, RTOL, "mlp input grad")
    _grads_match(ref, mlp, "mlp")

    # enter_tp_region on the attention: q, k and v share ONE backward all-reduce.
    attn = _Attn(d)
    ref_attn = copy.deepcopy(attn)
    for n in ("q", "k", "v"):
        setattr(attn, n, Linear1D_Col.from_native_module(getattr(attn, n), None))
    attn.o = Linear1D_Row.from_native_module(attn.o, None)
    handle = enter_tp_region(attn, None)
    for kwarg in (True, False):
        x = torch.randn(2, 3, d, requires_grad=True)
        with CommTracker() as fwd:
            y = attn(hidden_states=x) if kwarg else attn(x)
        with CommTracker() as bwd:
            y.sum().backward()
        assert fwd.calls() == 1 and bwd.calls() == 1, (fwd.table(), bwd.table())
        x_ref = x.detach().clone().requires_grad_()
        ref_attn(x_ref).sum().backward()
        assert_rel_close(x.grad, x_ref.grad, RTOL, "attention input grad")
    _grads_match(ref_attn, attn, "attention")
    handle.remove()
    x = torch.randn(2, 3, d, requires_grad=True)
    with CommTracker() as bwd_unhooked:
        y = attn(x)
        y.sum().backward()
    assert bwd_unhooked.calls("all_reduce") == 4, "without the hook each of q/k/v all-reduces"

    # Bad sizes name the module, the size and the TP size.
    odd = 6 if world_size == 4 else 3
    with pytest.raises(ValueError, match=rf"Linear1D_Col.*out_features={odd}.*size {world_size}"):
        Linear1D_Col.from_native_module(nn.Linear(d, odd), None)
    with pytest.raises(ValueError, match=r"n_fused=3"):
        Linear1D_Col.from_native_module(nn.Linear(d, 16), None, n_fused=3)
    with pytest.raises(ValueError, match=rf"Linear1D_Row.*in_features={odd}.*size {world_size}"):
        Linear1D_Row.from_native_module(nn.Linear(odd, d), None)


def test_linear_meta_and_single_rank() -> None:
    """Catches: meta natives materialized eagerly; a TP size of 1 not being the identity."""
    with torch.device("meta"):
        native = nn.Linear(8, 24)
    layer = Linear1D_Col.from_native_module(native, None, n_fused=3)
    assert layer.weight.is_meta and tuple(layer.weight.shape) == (24, 8)
    torch.manual_seed(0)
    native = nn.Linear(8, 4)
    layer = Linear1D_Row.from_native_module(copy.deepcopy(native), None)
    x = torch.randn(2, 8)
    assert_rel_close(layer(x), native(x), RTOL, "tp=1 row")
    assert "tp_size=1" in repr(layer)
