"""ColoInitContext: parameters become replicated ColoParameters that torch optimizers step.

A small MLP (with a tied weight) built under ``ColoInitContext`` at world 2 is compared with the
same MLP built outside from the same seed: the initial values, then the parameters after three
AdamW steps on the same batch (the ColoTensor model's input is a replicated ColoTensor) must be
equal to 1e-6 (the updates are ~1e-2).

Catches: parameters left as plain tensors or not registered as nn.Parameter (the optimizer
would not see them), values drawn by DTensor's own generator instead of the module's init
(different numbers from the serial model), a tie broken into two parameters, gradients that
differ from the serial ones, parameters left on the wrong device, and deepcopy / Module.to
failing or turning ColoParameters into plain DTensors (torch needs ``detach()`` to keep the
class).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from colossal.core.testing import distributed_test
from colossal.legacy.tensor import (
    ColoInitContext,
    ColoParameter,
    ColoTensor,
    ColoTensorSpec,
)

TOL = 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model[4].weight = model[2].weight  # tied
    return model


def _train(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        out = model(x)
        out = out.to_local() if isinstance(out, DTensor) else out
        ((out - target) ** 2).mean().backward()
        opt.step()


@distributed_test(2)
def test_colo_init_context_matches_serial_model(rank: int, world_size: int) -> None:
    """Built under the context vs outside: equal values, and equal after AdamW steps.

    Catches: see the module docstring.
    """
    torch.set_num_threads(1)
    ref = _model()
    with ColoInitContext(device=torch.device("cpu")):
        colo = _model()
    params = dict(colo.named_parameters())
    assert colo[4].weight is colo[2].weight  # the tie survives the conversion
    assert set(params) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        q = params[name]
        assert isinstance(q, ColoParameter) and isinstance(q, nn.Parameter), name
        assert q.is_leaf and q.requires_grad and q.is_replicate() and q.device.type == "cpu"
        assert torch.equal(q.to_local(), p.detach()), name
    twin = copy.deepcopy(colo).to("cpu")  # Module.to rebuilds each parameter from detach()
    assert twin[4].weight is twin[2].weight
    for name, q in twin.named_parameters():
        assert isinstance(q, ColoParameter) and isinstance(q, nn.Parameter), name
        assert torch.equal(q.to_local(), params[name].to_local()), name
        assert q.to_local().data_ptr() != params[name].to_local().data_ptr(), name
    torch.manual_seed(1)
    x, target = torch.randn(6, 4), torch.randn(6, 8)
    _train(ref, x, target)
    pg = params["0.weight"].get_process_group()
    assert (pg.tp_world_size(), pg.dp_world_size()) == (1, 2)
    _train(colo, ColoTensor.from_torch_tensor(x, ColoTensorSpec(pg)), target)
    for name, p in ref.named_parameters():
        moved = (params[name].to_local() - _model().get_parameter(name)).abs().max()
        assert moved > 1e-3, name  # the steps changed it, so equality below means something
        torch.testing.assert_close(params[name].to_local(), p.detach(), atol=TOL, rtol=0)
