"""to_replicate / set_dist_spec round trips with uneven sizes, and gradients through them.

At world 4 under tp 2 x dp 2 and tp 4, a known global (5, 7) tensor (rows split 3/2 at tp 2,
2/2/1/0 at tp 4; columns 4/3 and 2/2/2/1) is sharded on dim 0 and -1, replicated, resharded on
the other dim and back; every payload is compared with the slice torch's Shard rule gives.
Gradients: the plain loss sum(X * W) has dX = W; the same loss through a spec change (the
returned to_replicate / redistribute_spec, and the in-place set_dist_spec of a tensor inside a
graph) must give the same dX on every rank.

Catches: a split that drops or repeats rows of an uneven size, resharding along the wrong dim,
a to_replicate that returns a local part, a spec change that cuts the tensor out of the graph
(no gradient) or whose gradient is a part, or a part's worth of zeros, instead of W, and
payload-less ranks (the fourth rank's 0 rows) breaking. (The in-place relayout's own reverse
redistribution is not observable here: DTensor's from_local backward also redistributes the
gradient to its placements; a mutation dropping it passed.)
"""

from __future__ import annotations

import torch

from colossal.core.testing import distributed_test
from colossal.legacy.tensor import ColoTensor, ColoTensorSpec, ProcessGroup, ReplicaSpec, ShardSpec


def _part(whole: torch.Tensor, dim: int, k: int, n: int) -> torch.Tensor:
    """Part ``k`` of ``n`` of ``whole`` along ``dim`` (ceil-sized, the last ones fewer)."""
    size = whole.shape[dim]
    chunk = -(-size // n)
    lo = min(size, k * chunk)
    return whole.narrow(dim, lo, min(size, lo + chunk) - lo)


def _round_trips(pg: ProcessGroup, whole: torch.Tensor) -> None:
    """Shard on one dim, replicate, reshard on the other dim, and back."""
    tp, k = pg.tp_world_size(), pg.tp_local_rank()
    for first, second in ((0, -1), (-1, 0)):
        spec = ColoTensorSpec(pg, ShardSpec([first], [tp]))
        t = ColoTensor.from_torch_tensor(_part(whole, first, k, tp).clone(), spec)
        assert t.shape == whole.shape, (first, tp)
        rep = t.to_replicate()
        assert rep.is_replicate() and torch.equal(rep.to_local(), whole)
        rep.set_dist_spec(ShardSpec([second], [tp]))
        assert torch.equal(rep.to_local(), _part(whole, second, k, tp)), (first, second, tp)
        rep.set_dist_spec(ShardSpec([first], [tp]))
        assert torch.equal(rep.to_local(), _part(whole, first, k, tp)), (first, second, tp)
        rep.set_dist_spec(ReplicaSpec())
        assert torch.equal(rep.to_local(), whole)


def _grad_through(pg: ProcessGroup, whole: torch.Tensor, weight: torch.Tensor) -> None:
    """dX of sum(X * W) through each kind of spec change equals W."""
    tp, k = pg.tp_world_size(), pg.tp_local_rank()
    for dim in (0, -1):
        shard = ShardSpec([dim], [tp])
        # replicated -> sharded, as a returned tensor
        x = whole.clone().requires_grad_(True)
        part = ColoTensor.from_torch_tensor(x, ColoTensorSpec(pg)).redistribute_spec(shard)
        (part.to_local() * _part(weight, dim, k, tp)).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, weight), ("redistribute", dim, tp)
        # sharded -> replicated (to_replicate): each rank's part gets its slice of W
        x = _part(whole, dim, k, tp).clone().requires_grad_(True)
        spec = ColoTensorSpec(pg, shard)
        rep = ColoTensor.from_torch_tensor(x, spec).to_replicate()
        (rep.to_local() * weight).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, _part(weight, dim, k, tp)), (dim, tp)
        # in place, on a tensor inside a graph
        x = whole.clone().requires_grad_(True)
        t = ColoTensor.from_torch_tensor(x * 1.0, ColoTensorSpec(pg))
        t.set_dist_spec(shard)
        assert t.grad_fn is not None and t.is_sharded()
        (t.to_local() * _part(weight, dim, k, tp)).sum().backward()
        assert x.grad is not None and torch.equal(x.grad, weight), ("set_dist_spec", dim, tp)


@distributed_test(4)
def test_colotensor_round_trips_and_grads(rank: int, world_size: int) -> None:
    """Round trips and gradients at tp 2 x dp 2 and tp 4 (one spawn).

    Catches: see the module docstring.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    whole, weight = torch.randn(5, 7), torch.randn(5, 7)
    for pg in (ProcessGroup(tp_degree=2, dp_degree=2), ProcessGroup(tp_degree=4)):
        _round_trips(pg, whole)
        _grad_through(pg, whole, weight)
