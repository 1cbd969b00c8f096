"""Lazy initialization as ColossalAI's documentation page and tests/test_lazy use it.

A tiny GPT-2 built under ``LazyInitContext`` allocates no weights; ``materialize(model,
verbose=True)`` gives exactly the eagerly built weights (same seed); a lazy model moved with
``model.to(device)`` before ``boost`` (ColossalAI allows it) is materialized by
LowLevelZeroPlugin and GeminiPlugin with the eager weights, and its first loss equals the
eager model's.
"""

import colossalai
import torch
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from colossalai.lazy import LazyInitContext
from colossalai.nn.optimizer import HybridAdam
from colossalai.testing import check_state_dict_equal, rerun_if_address_is_in_use, spawn
from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(
    vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip


def build(lazy: bool) -> GPT2LMHeadModel:
    torch.manual_seed(7)
    if not lazy:
        return GPT2LMHeadModel(CONFIG)
    with LazyInitContext(default_device=get_accelerator().get_current_device()):
        return GPT2LMHeadModel(CONFIG)


def batch() -> dict:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def boost_and_step(model, plugin) -> tuple:
    optimizer = HybridAdam(model.parameters(), lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    # the plugin's wrapper may name its module "module." (as ColossalAI's ModelWrapper does)
    state = {k.removeprefix("module."): v.clone() for k, v in model.state_dict().items()}
    loss = model(**batch()).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    return state, loss.item()


def run_dist(rank, world_size, port):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    eager = build(lazy=False)
    model = build(lazy=True)
    assert all(p.is_meta for p in model.parameters()), "lazy init allocated weights"
    LazyInitContext.materialize(model, verbose=True)
    check_state_dict_equal(eager.state_dict(), model.state_dict())

    eager_loss = eager(**batch()).loss.item()
    device = get_accelerator().get_current_device()
    for name, make_plugin in [
        ("LowLevelZeroPlugin", lambda: LowLevelZeroPlugin(stage=2, precision="fp32")),
        ("GeminiPlugin", lambda: GeminiPlugin(precision="fp32")),
    ]:
        lazy_model = build(lazy=True).to(device)
        assert all(p.is_meta for p in lazy_model.parameters()), ".to() materialized early"
        lazy_state, lazy_loss = boost_and_step(lazy_model, make_plugin())
        check_state_dict_equal(eager.state_dict(), lazy_state)
        assert lazy_loss == eager_loss, f"{name}: {lazy_loss} != {eager_loss}"
        if rank == 0:
            print(f"{name}: lazy model boosted with the eager weights, loss {lazy_loss:.5f}")


@rerun_if_address_is_in_use()
def test_lazy_init():
    spawn(run_dist, 2)


if __name__ == "__main__":
    test_lazy_init()
    print("lazy_init: OK")
