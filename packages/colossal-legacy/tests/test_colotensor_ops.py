"""``set_output_replicate``, GPT-2 with dropout and with sdpa attention, at tp 2 (one world 2).

Catches: ``set_output_replicate(False)`` ignored (a column-split output gathered anyway) or the
default ignored (a split or ``Partial`` output left so), either changing values; dropout on a
ColoTensor GPT-2 refused (``bernoulli_`` on a ``Partial`` output) or drawing masks that differ
between the tp ranks or from the plain model under the same seed; transformers' ``sdpa``
attention refused (no DTensor strategy for CPU flash attention) or wrong with a padding mask.
"""

from __future__ import annotations

import torch
from test_colotensor_gpt import GPTLMModel, _apply_page_specs, _config, _loss, _whole
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from colossal.core.testing import distributed_test
from colossal.legacy.tensor import (
    ColoInitContext,
    ColoParameter,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ShardSpec,
)

VOCAB, SEQ = 64, 8


class _TwoLinears(nn.Module):
    """A column-split linear then a row-split one (Megatron's MLP, without activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 6)
        self.down = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def _split(param: nn.Parameter, dim: int, pg: ProcessGroup) -> ComputeSpec:
    assert isinstance(param, ColoParameter)
    param.set_process_group(pg)
    spec = ComputeSpec(ComputePattern.TP1D)
    param.set_tensor_spec(ShardSpec([dim], [pg.tp_world_size()]), spec)
    return spec


def _check_output_replicate(pg: ProcessGroup) -> None:
    """``up`` (nn.Linear: weight [out, in] split by rows = column-parallel) and ``down`` (split
    by columns = row-parallel): outputs' tp placements follow the compute specs."""
    torch.manual_seed(0)
    with ColoInitContext(device="cpu"):
        model = _TwoLinears()
    torch.manual_seed(0)
    ref = _TwoLinears()
    up_specs = [_split(model.up.weight, 0, pg), _split(model.up.bias, 0, pg)]
    _split(model.down.weight, -1, pg)
    model.down.bias.set_process_group(pg)  # type: ignore[attr-defined]
    seen: dict[str, tuple[object, ...]] = {}

    def record(name: str) -> object:
        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            assert isinstance(out, DTensor)
            seen[name] = tuple(out.placements)

        return hook

    model.up.register_forward_hook(record("up"))
    model.down.register_forward_hook(record("down"))
    x = torch.randn(3, 8)
    for flag in (True, False):
        for spec in up_specs:
            spec.set_output_replicate(flag)
        out = model(x)
        torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
        # recorded before the spec hook ran (registered later): DTensor's own placements
        assert seen["up"][1] == Shard(1) and isinstance(seen["down"][1], (Partial, Shard))
    # the spec hook's result is what the next module receives
    got: dict[str, DTensor] = {}
    model.down.register_forward_pre_hook(lambda m, a: got.__setitem__("in", a[0]))
    for flag, want in ((True, Replicate()), (False, Shard(1))):
        for spec in up_specs:
            spec.set_output_replicate(flag)
        out = model(x)
        assert got["in"].placements[1] == want, (flag, got["in"].placements)
        out.sum().backward()  # differentiable either way: gradients equal the plain model's
        ref(x).sum().backward()
        torch.testing.assert_close(_whole(model.up.weight.grad), ref.up.weight.grad)
        model.zero_grad()
        ref.zero_grad()


def _check_dropout(pg: ProcessGroup) -> None:
    """GPT-2 with dropout 0.1 everywhere: logits and gradients equal the plain model's under
    the same seed (so every rank drew the plain model's masks)."""
    cfg = _config()
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1
    torch.manual_seed(0)
    with ColoInitContext(device="cpu"):
        model = GPTLMModel(cfg)
    torch.manual_seed(0)
    ref = GPTLMModel(cfg)
    _apply_page_specs(model, pg)
    model.train()
    ref.train()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    torch.manual_seed(42)
    logits = model(ids, mask)
    _loss(logits, ids).backward()
    torch.manual_seed(42)
    ref_logits = ref(ids, mask)
    _loss(ref_logits, ids).backward()
    torch.manual_seed(43)
    other = ref(ids, mask)
    assert (other - ref_logits).abs().max() > 1e-3  # dropout is on: another seed differs
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(
            _whole(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check_sdpa(pg: ProcessGroup) -> None:
    """transformers' ``sdpa`` attention (CPU flash attention) with a padding mask: logits and
    gradients equal the plain model's."""
    torch.manual_seed(0)
    with ColoInitContext(device="cpu"):
        model = GPTLMModel(_config("sdpa"))
    torch.manual_seed(0)
    ref = GPTLMModel(_config("sdpa"))
    _apply_page_specs(model, pg)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: transformers passes a 4-d mask tensor
    logits = model(ids, mask)
    _loss(logits, ids).backward()
    ref_logits = ref(ids, mask)
    _loss(ref_logits, ids).backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(
            _whole(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@distributed_test(2)
def test_output_replicate_and_dropout(rank: int, world_size: int) -> None:
    """See the module doc."""
    torch.set_num_threads(1)
    pg = ProcessGroup(tp_degree=2)
    _check_output_replicate(pg)
    _check_dropout(pg)
    _check_sdpa(pg)
