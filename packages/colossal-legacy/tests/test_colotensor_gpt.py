"""The seeds' "Parallelize Your Training like Megatron-LM via ColoTensor" GPT-2 tutorial.

A transformers GPT-2 built inside ``ColoInitContext``, split by the page's parameter loop, is
trained 3 AdamW steps at tp 2 (world 2), tp 2 x dp 2 and tp 4 (world 4; each dp rank its half of the
batch) against the plain model on the whole batch.

Catches: a boundary that does not turn plain inputs into DTensors (mixed-tensor errors) or
returns DTensors to the loss, a split that does not shard (local shape not 1/tp), wrong
Megatron results from DTensor's propagation with the page's Shard(-1)/Shard(0) weights (loss,
gradients or parameters off), gradients summed instead of averaged over dp (2x), a plain tensor
saved for backward (position ids) that breaks the backward, gradients left ``Partial`` (not laid
out like their parameters), and an operator without a sharding strategy that is silently
replicated or whose error names neither the operator nor the placements.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel

from colossal.core.testing import distributed_test
from colossal.legacy.tensor import (
    ColoInitContext,
    ColoParameter,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ShardSpec,
)

VOCAB, SEQ, BATCH, STEPS = 64, 8, 4, 3


def _config(attn: str = "eager") -> GPT2Config:
    """The tiny GPT-2 (dropout off so both runs are deterministic)."""
    cfg = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=16,
        vocab_size=VOCAB,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = attn
    return cfg


class GPTLMModel(nn.Module):
    """The page's wrapper: returns the logits only."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The page's GPTLMLoss."""
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return nn.functional.cross_entropy(
        shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1)
    )


def split_param_single_dim_tp1d(dim: int, param: ColoParameter, pg: ProcessGroup) -> None:
    """The page's helper."""
    spec = (ShardSpec([dim], [pg.tp_world_size()]), ComputeSpec(ComputePattern.TP1D))
    if param.process_group.tp_world_size() == 1:
        param.set_process_group(pg)
    param.set_tensor_spec(*spec)


def _apply_page_specs(model: nn.Module, pg: ProcessGroup, attn_proj_row: bool = False) -> None:
    """The page's parameter loop, verbatim in effect.

    With ``attn_proj_row``, ``attn.c_proj``'s weight is split by rows and its bias replicated
    (Megatron's layout) instead of the page's column split of both.
    """
    for mn, module in model.named_modules():
        for pn, param in module.named_parameters(recurse=False):
            assert isinstance(param, ColoParameter)
            param.set_process_group(pg)
            if "mlp.c_fc" in mn:
                if "weight" in pn or "bias" in pn:
                    split_param_single_dim_tp1d(-1, param, pg)
                    assert param.compute_spec is not None
                    param.compute_spec.set_output_replicate(False)
            elif "mlp.c_proj" in mn or (attn_proj_row and "attn.c_proj" in mn):
                if "weight" in pn:
                    split_param_single_dim_tp1d(0, param, pg)
            elif "wte" in mn or "wpe" in mn:
                split_param_single_dim_tp1d(-1, param, pg)
            elif "c_attn" in mn or "c_proj" in mn:
                split_param_single_dim_tp1d(-1, param, pg)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_tutorial(rank: int, tp: int, dp: int, attn_proj_row: bool = False) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with ColoInitContext(device="cpu"):
        model = GPTLMModel(_config())
    torch.manual_seed(0)
    ref = GPTLMModel(_config())
    pg = ProcessGroup(tp_degree=tp, dp_degree=dp)
    _apply_page_specs(model, pg, attn_proj_row)

    params = dict(model.named_parameters())
    c_fc = params["model.transformer.h.0.mlp.c_fc.weight"]
    c_proj = params["model.transformer.h.0.mlp.c_proj.weight"]
    wte = params["model.transformer.wte.weight"]
    assert c_fc.to_local().shape == (32, 128 // tp)  # col: GPT-2's Conv1D is [in, out]
    assert c_proj.to_local().shape == (128 // tp, 32)  # row
    assert wte.to_local().shape == (VOCAB, 32 // tp)
    assert params["model.transformer.h.0.mlp.c_proj.bias"].is_replicate()
    attn_proj = params["model.transformer.h.0.attn.c_proj.weight"]
    assert attn_proj.to_local().shape == ((32 // tp, 32) if attn_proj_row else (32, 32 // tp))

    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    part = BATCH // dp
    lo = pg.dp_local_rank() * part
    for _step in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        mask = torch.ones_like(ids)
        logits = model(ids[lo : lo + part], mask[lo : lo + part])
        assert type(logits) is torch.Tensor and logits.shape == (part, SEQ, VOCAB)
        loss = _loss(logits, ids[lo : lo + part])
        loss.backward()
        ref_logits = ref(ids, mask)
        torch.testing.assert_close(logits, ref_logits[lo : lo + part], rtol=1e-5, atol=1e-5)
        _loss(ref_logits, ids).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None, name
            assert tuple(p.grad.placements) == tuple(p.placements), name
            torch.testing.assert_close(
                _whole(p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        got, want = _whole(p.detach()), q.detach()
        if name.endswith("attn.c_attn.bias"):
            # the key bias has a zero true gradient (softmax ignores it); AdamW turns both
            # runs' round-off (~1e-9) into steps of up to ~1e-5, against lr 1e-2 per step
            key = slice(32, 64)
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-4)
            got[key] = want[key]
        # atol 1e-5: AdamW divides by sqrt(v), so tiny gradients' round-off moves a weight by
        # ~1e-6; a wrong gradient or a missed step moves it by ~lr = 1e-2
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


@distributed_test(2)
def test_gpt2_tp2_matches_plain(rank: int, world_size: int) -> None:
    """tp 2: the page's specs, 3 AdamW steps equal the plain model; then the refusals.

    (One world-2 case, to pay the process start and the transformers import once.)
    Catches: see the module doc and :func:`_check_refusals`.
    """
    _check_tutorial(rank, tp=2, dp=1)
    _check_refusals()


@distributed_test(4)
def test_gpt2_world4_matches_plain(rank: int, world_size: int) -> None:
    """World 4 (one process start): tp 2 x dp 2, then tp 4 x dp 1, 3 AdamW steps each.

    tp 2 x dp 2 takes half the batch per dp rank with attn.c_proj split by rows (Megatron's
    layout); tp 4 keeps the page's specs: 8 of the 32 hidden columns of wte/wpe per rank, and
    24 of c_attn's 96 fused q/k/v columns (a part straddles the q/k boundary).

    Catches: dp gradients summed, not averaged; a row-split attention projection wrong; a
    layout that only works for two parts (the fused q/k/v split four ways, embeddings split
    four ways) giving wrong losses, gradients or parameters.
    """
    _check_tutorial(rank, tp=2, dp=2, attn_proj_row=True)
    _check_tutorial(rank, tp=4, dp=1)


class _Searches(nn.Module):
    """A linear then ``torch.searchsorted``, which DTensor has no sharding strategy for."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.searchsorted(y, y)


def _check_refusals() -> None:
    """An operator without a DTensor strategy: the error names it and the placements.

    Also: parameters left on two process groups are refused naming one and the fix.
    Catches: a silent replicate-everything fallback, an error without the operator's name, a
    model on mixed meshes that fails deep inside DTensor (or runs) instead.
    """
    torch.set_num_threads(1)
    pg = ProcessGroup(tp_degree=2)
    with ColoInitContext(device="cpu"):
        model = _Searches()
    for param in model.parameters():
        assert isinstance(param, ColoParameter)
        param.set_process_group(pg)
    model.lin.weight.set_dist_spec(ShardSpec([0], [2]))  # type: ignore[operator]
    with pytest.raises(NotImplementedError) as info:
        model(torch.zeros(2, 4))
    text = str(info.value)
    assert "searchsorted" in text and "placements [(" in text, text
    assert "Shard(dim=1)" in text, text  # the linear's column-split output

    with ColoInitContext(device="cpu"):
        mixed = nn.Linear(4, 4)
    mixed.weight.set_process_group(ProcessGroup(tp_degree=2))  # the bias stays on tp 1
    with pytest.raises(ValueError, match="set_process_group"):
        mixed(torch.zeros(2, 4))
