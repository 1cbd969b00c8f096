"""The Booster's plugins train a tiny GPT-2 like one process does (ColossalAI's
tests/test_booster/test_plugin pattern: spawn, launch, boost, backward through the booster).

Every plugin trains the same model from the same seed on the same batch (replicated on both
ranks, so data parallel averaging changes nothing) for STEPS Adam steps, in fp32: its losses
must equal the single-process run's to TOL. Plugins: TorchDDPPlugin, LowLevelZeroPlugin
(ZeRO-2; ZeRO-1 against ZeRO-2 is in zero_optimizer.py), GeminiPlugin and
HybridParallelPlugin (tensor parallel 2).
"""

import colossalai
import torch
from colossalai.booster import Booster
from colossalai.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
)
from colossalai.nn.optimizer import HybridAdam
from colossalai.testing import rerun_if_address_is_in_use, spawn
from transformers import GPT2Config, GPT2LMHeadModel

STEPS = 3
TOL = 2e-4
CONFIG = GPT2Config(
    vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(42)
    return GPT2LMHeadModel(CONFIG)


def make_batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=generator)
    return {"input_ids": ids, "labels": ids}


def reference_losses() -> list:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(**make_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train(plugin) -> list:
    model = make_model()
    optimizer = HybridAdam(model.parameters(), lr=1e-2, adamw_mode=False)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    losses = []
    for _ in range(STEPS):
        loss = model(**make_batch()).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_dist(rank, world_size, port):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    expected = reference_losses()
    assert expected[-1] < expected[0] - 0.05, f"the reference does not learn: {expected}"
    plugins = {
        "TorchDDPPlugin": TorchDDPPlugin(),
        "LowLevelZeroPlugin(stage=2)": LowLevelZeroPlugin(stage=2, precision="fp32"),
        "GeminiPlugin": GeminiPlugin(precision="fp32", placement_policy="static"),
        "HybridParallelPlugin(tp_size=2)": HybridParallelPlugin(
            tp_size=2, pp_size=1, precision="fp32"
        ),
    }
    for name, plugin in plugins.items():
        losses = train(plugin)
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= TOL * abs(want), f"{name}: {losses} vs {expected}"
        if rank == 0:
            print(f"{name}: losses {[round(x, 5) for x in losses]} (reference {expected[-1]:.5f})")


@rerun_if_address_is_in_use()
def test_booster_plugins():
    spawn(run_dist, 2)


if __name__ == "__main__":
    test_booster_plugins()
    print("booster_plugins: OK")
