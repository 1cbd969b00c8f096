"""The sharder on its own (single process, stand-in parallel layers): dotted attributes,
replacements in order (embeddings first, so tied heads stay tied), TP regions, and the
parameter check that refuses lost, new or untied parameters."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    SubModuleReplacementDescription,
)
from colossal.shardformer.shard import apply_module_policy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.num_heads = 4
        self.attn.q = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


class Record:
    """Stand-in layer: returns the module itself and logs the order of calls."""

    calls: list[str] = []

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group: Any, **kwargs: Any) -> nn.Module:
        cls.calls.append(type(module).__name__)
        if isinstance(module, nn.Linear) and module.out_features == 10:
            # A head: "reuses" the weight only if the embedding was handled first.
            assert Record.calls[0] == "Embedding", "LM head replaced before the embedding"
        return module


class Renamed:
    @classmethod
    def from_native_module(cls, module: nn.Module, process_group: Any, **kwargs: Any) -> nn.Module:
        new = nn.Module()
        new.kernel = nn.Parameter(module.weight.detach().clone())
        return new


class Copied:
    @classmethod
    def from_native_module(cls, module: nn.Module, process_group: Any, **kwargs: Any) -> nn.Module:
        return copy.deepcopy(module)


@pytest.fixture(autouse=True)
def _fake_region(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    entered: list[nn.Module] = []
    import colossal.shardformer.layer as layer

    monkeypatch.setattr(layer, "enter_tp_region", lambda m, g: entered.append(m))
    Record.calls = []
    return entered


def test_attributes_replacements_and_regions_are_applied(_fake_region: list[nn.Module]) -> None:
    model = Toy()
    policy = {
        Block: ModulePolicyDescription(
            attribute_replacement={"attn.num_heads": 2},
            sub_module_replacement=[
                SubModuleReplacementDescription("attn.q", Record),
                SubModuleReplacementDescription("missing", Record, ignore_if_not_exist=True),
            ],
            tp_region_inputs=["attn"],
        ),
        # Head listed before the embedding: the sharder still does the embedding first.
        "Toy": ModulePolicyDescription(
            sub_module_replacement=[
                SubModuleReplacementDescription("head", Record),
                SubModuleReplacementDescription("embed", Record),
            ]
        ),
    }
    summary = apply_module_policy(model, policy, None)
    assert [b.attn.num_heads for b in model.blocks] == [2, 2]
    assert Record.calls[0] == "Embedding" and len(Record.calls) == 4
    assert sorted(summary.replaced) == ["blocks.0.attn.q", "blocks.1.attn.q", "embed", "head"]
    assert _fake_region == [model.blocks[0].attn, model.blocks[1].attn]
    assert summary.tp_regions == ["blocks.0.attn", "blocks.1.attn"]


def test_missing_submodule_is_an_error_naming_it() -> None:
    policy = {Block: ModulePolicyDescription(
        sub_module_replacement=[SubModuleReplacementDescription("attn.k", Record)])}  # fmt: skip
    with pytest.raises(ValueError, match=r"no submodule 'attn.k'"):
        apply_module_policy(Toy(), policy, None)


def test_renamed_parameters_are_refused() -> None:
    policy = {Block: ModulePolicyDescription(
        sub_module_replacement=[SubModuleReplacementDescription("mlp", Renamed)])}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"lost \['blocks.0.mlp.bias'"):
        apply_module_policy(Toy(), policy, None)


def test_untying_a_tied_head_is_refused() -> None:
    policy = {"Toy": ModulePolicyDescription(
        sub_module_replacement=[SubModuleReplacementDescription("head", Copied)])}  # fmt: skip
    with pytest.raises(RuntimeError, match="untied"):
        apply_module_policy(Toy(), policy, None)


def test_a_custom_policy_goes_through_optimize(monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimize(model, policy=MyPolicy())`` runs the hooks in ColossalAI's order."""
    import torch.distributed as dist

    from colossal.shardformer.policies.base_policy import Policy
    from colossal.shardformer.shard import ShardConfig, ShardFormer

    order: list[str] = []

    class MyPolicy(Policy):
        def config_sanity_check(self) -> None:
            order.append("check")

        def preprocess(self) -> nn.Module:
            order.append("pre")
            return super().preprocess()

        def module_policy(self) -> dict:
            order.append("policy")
            return {Block: ModulePolicyDescription(attribute_replacement={"attn.num_heads": 1})}

        def postprocess(self) -> nn.Module:
            order.append("post")
            return super().postprocess()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    model, shared = ShardFormer(ShardConfig()).optimize(Toy(), policy=MyPolicy())
    assert order == ["check", "pre", "policy", "post"] and shared == []
    assert model.blocks[0].attn.num_heads == 1
    assert isinstance(model.head.weight, torch.nn.Parameter)
