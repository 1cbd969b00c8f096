"""The seeds' ColoTensor imports (colotensor_concept.md, the Megatron-via-ColoTensor tutorial).

Catches: a ``colossalai.tensor`` or ``colossalai.utils.model.colo_init_context`` name that is
missing, or served as a copy instead of Colossal's own object (``isinstance`` against the
seeds' class would then fail on our tensors), and the old "not implemented" answer for
``ColoInitContext`` coming back.
"""

from __future__ import annotations

import colossal.legacy.tensor as ours
from colossal.core.testing import distributed_test

SEED_IMPORTS = (
    "from colossalai.tensor import ProcessGroup, ColoTensor, ColoTensorSpec, ShardSpec, "
    "ComputeSpec, ComputePattern",
    "from colossalai.tensor import ShardSpec, ComputeSpec, ComputePattern, ColoParameter, "
    "ProcessGroup",
    "from colossalai.tensor.distspec import ShardSpec, ReplicaSpec",
    "from colossalai.utils.model.colo_init_context import ColoInitContext",
    "from colossalai.legacy.tensor import ColoTensor",
)


def test_seed_colotensor_imports_are_ours() -> None:
    """Every name the seeds import is the object of ``colossal.legacy.tensor``."""
    for line in SEED_IMPORTS:
        scope: dict[str, object] = {}
        exec(line, scope)
        names = [n for n in scope if n != "__builtins__"]
        assert names, line
        for name in names:
            assert scope[name] is getattr(ours, name), (line, name)


def test_page_gemini_name_is_ours() -> None:
    """Catches ``colossalai.nn.parallel.GeminiDDP`` served as another class than the legacy one."""
    from colossalai.nn.parallel import GeminiDDP

    import colossal.legacy.zero as legacy_zero

    assert GeminiDDP is legacy_zero.GeminiDDP


_PAGE = """
import torch
import torch.nn as nn
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel
from colossalai.tensor import ProcessGroup, ReplicaSpec
from colossalai.tensor import ShardSpec, ComputeSpec, ComputePattern, ColoParameter
from colossalai.utils import get_current_device
from colossalai.utils.model.colo_init_context import ColoInitContext


class GPTLMModel(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=32,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "eager"
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


def split_param_single_dim_tp1d(dim, param, pg):
    spec = (ShardSpec([dim], [pg.tp_world_size()]), ComputeSpec(ComputePattern.TP1D))
    if param.process_group.tp_world_size() == 1:
        param.set_process_group(pg)
    param.set_tensor_spec(*spec)


def tensor_parallelize(model, pg):
    for mn, module in model.named_modules():
        for pn, param in module.named_parameters(recurse=False):
            param.set_process_group(pg)
            if "mlp.c_fc" in mn:
                if "weight" in pn or "bias" in pn:
                    split_param_single_dim_tp1d(-1, param, pg)
                    param.compute_spec.set_output_replicate(False)
            elif "mlp.c_proj" in mn:
                if "weight" in pn:
                    split_param_single_dim_tp1d(0, param, pg)
            elif "wte" in mn or "wpe" in mn:
                split_param_single_dim_tp1d(-1, param, pg)
            elif "c_attn" in mn or "c_proj" in mn:
                split_param_single_dim_tp1d(-1, param, pg)


def gemini_zero_dpp(model, pg, placement_policy="auto"):
    from colossalai.nn.parallel import GeminiDDP
    return GeminiDDP(model, device=get_current_device(), placement_policy=placement_policy,
                     pin_memory=True, search_range_mb=32)
"""


@distributed_test(2)
def test_page_program_through_colossalai(rank: int, world_size: int) -> None:
    """The page's code through ``import colossalai`` names: tp = world trains a step with
    every split parameter 1/tp locally; ``gemini_zero_dpp`` of that model is refused naming
    the supported routes, and at tp 1 x dp 2 wraps and trains.

    Catches: a page name missing or behaving differently under ``colossalai.*`` (the
    ``set_output_replicate`` call, ``get_current_device``, GeminiDDP's seeds' arguments), a
    tp-split model silently chunked by Gemini.
    """
    import pytest
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    scope: dict[str, object] = {}
    exec(compile(_PAGE, "<page>", "exec"), scope)
    pg_cls = scope["ProcessGroup"]
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    with scope["ColoInitContext"](device=torch.device("cpu")):  # type: ignore[operator]
        model = scope["GPTLMModel"]()  # type: ignore[operator]
    pg = pg_cls(tp_degree=dist.get_world_size())  # type: ignore[operator]
    scope["tensor_parallelize"](model, pg)  # type: ignore[operator]
    wte = model.model.transformer.wte.weight
    assert wte.to_local().shape == (32, 16 // world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(ids, torch.ones_like(ids))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), ids.reshape(-1))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="GeminiPlugin"):
        scope["gemini_zero_dpp"](model, pg, "cuda")  # type: ignore[operator]

    dp_pg = pg_cls(tp_degree=1, dp_degree=world_size)  # type: ignore[operator]
    with scope["ColoInitContext"](device=torch.device("cpu"), default_pg=dp_pg):  # type: ignore[operator]
        small = scope["GPTLMModel"]()  # type: ignore[operator]
    wrapped = scope["gemini_zero_dpp"](small, dp_pg, "cuda")  # type: ignore[operator]
    from colossal.legacy.zero import GeminiAdamOptimizer

    opt = GeminiAdamOptimizer(wrapped, lr=1e-2)
    out = wrapped(ids, torch.ones_like(ids))
    opt.backward(torch.nn.functional.cross_entropy(out.reshape(-1, 32).float(), ids.reshape(-1)))
    opt.step()
