"""Pipeline 2 x 1D tensor parallel 2 through the config (the GPT hybrid page) vs one process.

World 4, ``parallel=dict(pipeline=2, tensor=dict(mode='1d', size=2))``: a GPT of
``colossalai.nn`` layers (1D embedding, head-by-head fused qkv column-parallel, dense and MLP
output row-parallel, the head on the last stage tied to the first stage's embedding through
``PipelineSharedModuleWrapper``) trains one clipped SGD step with the Engine's pipeline
schedule; the last stage's loss and every parameter after the step are compared with the
whole model trained in one process on the same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from _nn_layer_cases import PLAIN
from torch import nn

import colossal.legacy.nn as col_nn
from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc
from colossal.legacy.pipeline import PipelineSharedModuleWrapper
from colossal.shardformer.layer import Embedding1D, Linear1D_Col, Linear1D_Row

VOCAB, DIM, HEADS, SEQ, BATCH = 16, 8, 4, 5, 4
LR, CLIP = 0.5, 0.05
TOL = dict(atol=2e-5, rtol=1e-4)


class _Block(nn.Module):
    def __init__(self, c: object) -> None:
        super().__init__()
        self.norm1 = c.LayerNorm(DIM)  # type: ignore[attr-defined]
        self.qkv = c.Linear(DIM, 3 * DIM)  # type: ignore[attr-defined]
        self.dense = c.Linear(DIM, DIM)  # type: ignore[attr-defined]
        self.norm2 = c.LayerNorm(DIM)  # type: ignore[attr-defined]
        self.fc1 = c.Linear(DIM, 2 * DIM)  # type: ignore[attr-defined]
        self.fc2 = c.Linear(2 * DIM, DIM)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm1(x))
        b, s, width = qkv.shape
        size = DIM // HEADS
        heads = width // (3 * size)  # this rank's heads
        q, k, v = qkv.reshape(b, s, heads, 3 * size).transpose(1, 2).chunk(3, dim=-1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dense(att.transpose(1, 2).flatten(2))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class _GPT(nn.Module):
    """Embedding on the first stage, ``blocks`` blocks, norm and head on the last."""

    def __init__(self, c: object, first: bool, last: bool, blocks: int) -> None:
        super().__init__()
        self.embed = c.Embedding(VOCAB, DIM) if first else None  # type: ignore[attr-defined]
        self.blocks = nn.ModuleList(_Block(c) for _ in range(blocks))
        self.norm = c.LayerNorm(DIM) if last else None  # type: ignore[attr-defined]
        tied = self.embed.weight if first and last else None  # type: ignore[union-attr]
        self.head = (
            c.Classifier(DIM, VOCAB, weight=tied, bias=False)  # type: ignore[attr-defined]
            if last
            else None
        )

    def forward(
        self, hidden_states: torch.Tensor | None = None, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.embed is not None:
            hidden_states = self.embed(ids)
        assert hidden_states is not None
        for block in self.blocks:
            hidden_states = block(hidden_states)
        if self.head is not None:
            assert self.norm is not None
            hidden_states = self.head(self.norm(hidden_states))
        return hidden_states


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _stage_state(whole: dict[str, torch.Tensor], stage: int) -> dict[str, torch.Tensor]:
    """The whole model's entries a stage holds, under the stage's names (block 1 -> 0)."""
    if stage == 0:
        return {k: v for k, v in whole.items() if k.startswith(("embed.", "blocks.0."))}
    state = {k.replace("blocks.1.", "blocks.0."): v for k, v in whole.items()}
    state = {k: v for k, v in state.items() if k.startswith(("blocks.0.", "norm.", "head."))}
    if "head.weight" not in state:  # tied: the head's weight is the embedding's
        state["head.weight"] = whole["embed.weight"]
    return state


def _train_one_step(parallel: dict) -> None:
    """One clipped SGD step of the pipelined GPT under ``parallel``, checked against the
    whole model (every data-parallel replica reads the same batch)."""
    config = dict(parallel=parallel, NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP)
    init_context(config, verbose=False)
    stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    one_d = "tensor" in parallel

    torch.manual_seed(0)
    reference = _GPT(PLAIN, first=True, last=True, blocks=2)
    gpc.layer_env.reset()
    model = _GPT(col_nn, first=stage == 0, last=stage == 1, blocks=1)
    model.load_state_dict(_stage_state(reference.state_dict(), stage))
    wrapper = PipelineSharedModuleWrapper([0, 1])
    if stage == 0:
        assert type(model.embed) is (Embedding1D if one_d else nn.Embedding)
        wrapper.register_module(model.embed)
    else:
        assert type(model.head) is (Linear1D_Row if one_d else nn.Linear)
        wrapper.register_module(model.head)
    if one_d:
        block = model.blocks[0]
        assert type(block.qkv) is Linear1D_Col and type(block.fc2) is Linear1D_Row

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = initialize(model, optimizer, _loss, verbose=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    engine.zero_grad()
    _, _, loss = engine.execute_schedule(iter([(dict(ids=ids), labels)]))
    engine.step()

    ref_loss = _loss(reference(ids=ids), labels)
    ref_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
    assert norm > 4 * CLIP, "the clip must be active to test the norm"
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    if stage == 1:
        assert loss is not None
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), **TOL)
    want = _stage_state(reference.state_dict(), stage)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=f"{parallel} {stage}: {key}")
    dist.barrier()
    gpc.destroy()


@distributed_test(4)
def test_pipeline_x_1d_equals_the_whole_model(rank: int, world_size: int) -> None:
    """Catches: tensor-parallel ranks of a stage paired with the wrong ranks of the next, a
    tied embedding/head pair laid out differently on the two stages (the wrapper's broadcast
    would fail or mix columns), a shared gradient not summed over the stages, a 1D shard, a
    replicated LayerNorm/bias, a pipeline copy or a data-parallel replica counted twice (or
    never) in the clipped norm (the step came out 0.77x the whole model's before replicas
    were marked), local heads taken from the whole width, microbatch losses not averaged,
    and a stage's ``state_dict()`` waiting on the other stages."""
    torch.set_num_threads(1)
    _train_one_step(dict(pipeline=2, tensor=dict(mode="1d", size=2)))
    _train_one_step(dict(pipeline=2))  # and data parallel 2
