"""GeminiDDP: hooks drive the chunks; reduced gradient shards equal a single-process reference.

Each rank runs its slice of the global batch; the reference is an fp32 copy of the model run
on every slice in one process, its gradients averaged over the slices. A rank's gradient
shard (``chunk.tensor_shard(p, source="grad")``) must equal the reference gradient's slice.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional

from colossal.core import CommTracker
from colossal.core.testing import distributed_test
from colossal.gemini import DeviceMemoryExceeded, GeminiDDP, TensorState

H, V, B, T = 8, 12, 4, 3
CHUNK = {"chunk_size": 80}


class Net(nn.Module):
    """Embedding, two layers, an auxiliary head and an output head (optionally tied/LoRA)."""

    def __init__(self, *, tied: bool = False, lora: bool = False, hidden: int = H,
                 vocab: int = V, depth: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.l1 = nn.Linear(hidden, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.extra = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.aux = nn.Linear(hidden, 1)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.lora = lora
        if lora:
            self.l1.requires_grad_(False)
            self.lora_a = nn.Linear(hidden, 2, bias=False)
            self.lora_b = nn.Linear(2, hidden, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(ids)
        z = self.l1(h)
        if self.lora:
            z = z + self.lora_b(self.lora_a(h))
        h = torch.tanh(self.l2(torch.tanh(z)))
        for layer in self.extra:
            h = torch.tanh(layer(h))
        return self.head(h), self.aux(h)


def _loss(model: nn.Module, ids: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
    logits, aux = model(ids)
    loss = functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           ((ids + 1) % logits.shape[-1]).reshape(-1))
    return loss + aux.float().pow(2).mean() if use_aux else loss


def _batch(world: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B * world, T), generator=g)


def _reference(model: nn.Module, ids: torch.Tensor, world: int,
               aux_ranks: set[int] | None = None) -> dict[str, torch.Tensor]:
    model.zero_grad()
    for r, part in enumerate(ids.chunk(world)):
        use_aux = aux_ranks is None or r in aux_ranks
        (_loss(model, part, use_aux) / world).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_grads(ddp: GeminiDDP, ref: dict[str, torch.Tensor], rtol: float, atol: float,
                 what: str) -> None:
    shards = ddp.trainable_shards()
    assert {s.name for s in shards} == set(ref), (what, sorted(ref))
    for name, p, chunk in shards:
        start, stop, got = chunk.tensor_shard(p, source="grad")
        want = ref[name].reshape(-1)[start:stop]
        scale = max(float(ref[name].abs().max()), 1e-6)
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * scale,
                                   msg=lambda m, n=name: f"{what}: {n}: {m}")


def _make(seed: int = 0, **kw: object) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = Net(**kw)  # type: ignore[arg-type]
    return model, copy.deepcopy(model)


def _step(ddp: GeminiDDP, ids: torch.Tensor, rank: int, world: int, use_aux: bool = True) -> None:
    ddp.backward(_loss(ddp, ids.chunk(world)[rank], use_aux))


def test_single_process_fp32_grads_and_validation() -> None:
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK)
    ids = _batch(1)
    _step(ddp, ids, 0, 1)
    _check_grads(ddp, _reference(ref_model, ids, 1), 1e-5, 1e-6, "world 1 fp32")
    assert all(c.states()[TensorState.FREE] == len(c.params) for c in ddp.chunk_manager.chunks
               if not c.keep_gathered), "every sharded chunk is released after the step"
    assert all(p.grad is None for p in model.parameters()), "p.grad is moved into the chunk"
    with pytest.raises(ValueError, match="precision"):
        GeminiDDP(Net(), precision="fp8")
    with pytest.raises(ValueError, match="chunk_config_dict"):
        GeminiDDP(Net(), chunk_config_dict={"size": 3})
    with pytest.raises(RuntimeError, match="enable_gradient_accumulation"):
        with ddp.no_sync():
            pass


@distributed_test(2)
def test_gemini_ddp_world2(rank: int, world_size: int) -> None:
    ids = _batch(world_size)

    # fp32: exact-ish gradients; one all-gather per sharded chunk in forward and one in
    # backward (a chunk gathered twice, or never released, changes the counts), one
    # reduce-scatter per trainable chunk per step.
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK)
    chunks = ddp.chunk_manager.chunks
    assert len(chunks) >= 4
    with CommTracker() as tracker:
        out = ddp(ids.chunk(world_size)[rank])
        fwd_gathers = tracker.calls("all_gather")
        ddp.backward(_loss_from(out, ids.chunk(world_size)[rank]))
    assert fwd_gathers == len(chunks), (fwd_gathers, chunks)
    assert tracker.calls("all_gather") == 2 * len(chunks)
    assert tracker.calls("reduce_scatter") == len(chunks)
    assert tracker.calls("all_reduce") == 0
    _check_grads(ddp, _reference(ref_model, ids, world_size), 1e-5, 1e-6, "fp32")
    assert not any(c.is_gathered for c in chunks), "released after backward"

    # A second step (gradients replaced, not added, without accumulation).
    _step(ddp, ids, rank, world_size)
    _check_grads(ddp, _reference(ref_model, ids, world_size), 1e-5, 1e-6, "fp32 step 2")

    # bf16 and fp16: the chunks compute in low precision; gradient shards keep it.
    for precision in ("bf16", "fp16"):
        model, ref_model = _make()
        ddp = GeminiDDP(model, precision=precision, chunk_config_dict=CHUNK)
        _step(ddp, ids, rank, world_size)
        assert all(c.grad_shard.dtype == ddp.compute_dtype for c in ddp.chunk_manager.chunks)
        tol = 4e-2 if precision == "bf16" else 5e-3
        _check_grads(ddp, _reference(ref_model, ids, world_size), tol, tol, precision)

    # shard_param_frac=0: every chunk kept gathered, never all-gathered; one all-reduce each.
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK, shard_param_frac=0.0)
    with CommTracker() as tracker:
        _step(ddp, ids, rank, world_size)
    assert all(c.keep_gathered for c in ddp.chunk_manager.chunks)
    assert tracker.calls("all_gather") == 0
    assert tracker.calls("all_reduce") == len(ddp.chunk_manager.chunks)
    _check_grads(ddp, _reference(ref_model, ids, world_size), 1e-5, 1e-6, "kept gathered")

    # The auxiliary head reaches the loss on rank 0 only: rank 1 never runs its backward.
    # The bug: a hang (rank 1 skips a gather or a reduction) or a skipped/zeroed reduction.
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK)
    with CommTracker() as tracker:
        _step(ddp, ids, rank, world_size, use_aux=rank == 0)
    assert tracker.calls("all_gather") == 2 * len(ddp.chunk_manager.chunks)
    assert tracker.calls("reduce_scatter") == len(ddp.chunk_manager.chunks)
    _check_grads(ddp, _reference(ref_model, ids, world_size, aux_ranks={0}), 1e-5, 1e-6,
                 "aux unused on rank 1")

    # LoRA-style: a frozen base linear gets its own chunk with no master and no gradient.
    model, ref_model = _make(lora=True)
    ddp = GeminiDDP(model, precision="bf16", chunk_config_dict=CHUNK)
    frozen = [c for c in ddp.chunk_manager.chunks if not c.requires_grad]
    assert [ddp.chunk_manager.name_of(p) for c in frozen for p in c.params] == \
        ["l1.weight", "l1.bias"]
    _step(ddp, ids, rank, world_size)
    for chunk in frozen:
        assert chunk.master is None and chunk.grad_shard is None
    assert all(not n.startswith("l1.") for n, _, _ in ddp.trainable_shards())
    _check_grads(ddp, _reference(ref_model, ids, world_size), 4e-2, 4e-2, "lora")

    # Tied embedding/head: one chunk, one gradient (both uses summed); the forward gathers
    # the tied chunk a second time for the head.
    model, ref_model = _make(tied=True)
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK)
    n = len(ddp.chunk_manager.chunks)
    with CommTracker() as tracker:
        _step(ddp, ids, rank, world_size)
    assert tracker.calls("all_gather") == 2 * n + 1
    assert tracker.calls("reduce_scatter") == n
    _check_grads(ddp, _reference(ref_model, ids, world_size), 1e-5, 1e-6, "tied")
    # state_dict keeps both names of the tied weight, as torch's (catches the duplicate
    # dropped: loading it into the plain model would then fail on head.weight).
    full, want = ddp.state_dict(), ref_model.state_dict()
    assert list(full) == list(want) and "head.weight" in full
    assert full["head.weight"] is full["emb.weight"]
    for name, t in want.items():
        assert torch.equal(full[name], t), name
    plain = Net(tied=True)
    plain.load_state_dict(full)  # strict
    # load_state_dict reads a tied weight under any of its names.
    changed = {k: v + 1 for k, v in full.items() if k != "emb.weight"}
    ddp.load_state_dict(changed)
    torch.testing.assert_close(ddp.state_dict()["emb.weight"], full["emb.weight"] + 1)

    # Gradient accumulation: two micro-batches under no_sync equal the large batch.
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict=CHUNK,
                    enable_gradient_accumulation=True)
    local = ids.chunk(world_size)[rank]
    with ddp.no_sync():
        ddp.backward(_loss(ddp, local[: B // 2]) / 2)
    ddp.backward(_loss(ddp, local[B // 2 :]) / 2)
    ref_model.zero_grad()
    for r in range(world_size):
        part = ids.chunk(world_size)[r]
        for half in (part[: B // 2], part[B // 2 :]):
            (_loss(ref_model, half) / (2 * world_size)).backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    _check_grads(ddp, ref, 1e-5, 1e-6, "accumulation")


def _loss_from(out: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    logits, aux = out
    loss = functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                           ((ids + 1) % logits.shape[-1]).reshape(-1))
    return loss + aux.float().pow(2).mean()


@distributed_test(2)
def test_gemini_ddp_device_memory_limit(rank: int, world_size: int) -> None:
    # Everything offloaded (params and optimizer side on the host): the device holds only
    # the gathered payloads and gradient buffers of the chunks in use, under a limit well
    # below the model's size; the gradients are unchanged.
    ids = torch.randint(0, 32, (2 * world_size, 3), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = Net(hidden=32, vocab=32, depth=8)
    ref_model = copy.deepcopy(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    limit = 24 * 1024  # launched reductions are waited for when a buffer would not fit
    assert model_bytes > 2 * limit
    ddp = GeminiDDP(model, precision="fp32", chunk_config_dict={"chunk_size": 1100},
                    offload_param_frac=1.0, offload_optim_frac=1.0, device_memory_limit=limit)
    assert ddp.budget.used("device") == 0
    # Building charges every allocation to the budget and puts each chunk straight where the
    # plan says: the device held at most the chunk being filled and its trimmed copy
    # (catches building every shard on the device and moving it after: ~25 KB here).
    assert 0 < ddp.construction_peak <= 2 * 4400 + 4400 // world_size
    assert ddp.budget.used("host") == ddp.chunk_manager.memory()["host"] > model_bytes // 2
    ddp.backward(_loss(ddp, ids.chunk(world_size)[rank]))
    assert 0 < ddp.budget.peak("device") <= limit
    ref_model.zero_grad()
    for part in ids.chunk(world_size):
        (_loss(ref_model, part) / world_size).backward()
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    for name, p, chunk in ddp.trainable_shards():
        assert chunk.master_location == "host" and chunk.shard_location == "host"
        start, stop, got = chunk.tensor_shard(p, source="grad")
        torch.testing.assert_close(got, ref[name].reshape(-1)[start:stop], rtol=1e-5, atol=1e-6)

    # A limit below one chunk cannot work: building fails with a clear DeviceMemoryExceeded
    # naming the need and the limit (catches construction bytes hidden from the budget).
    torch.manual_seed(0)
    with pytest.raises(DeviceMemoryExceeded, match="payload") as info:
        GeminiDDP(Net(hidden=32, vocab=32, depth=8), precision="fp32",
                  chunk_config_dict={"chunk_size": 1100}, offload_param_frac=1.0,
                  offload_optim_frac=1.0, device_memory_limit=2048)
    assert info.value.needed == 4400 and info.value.limit == 2048
    assert "needs 4400 B" in str(info.value) and "limit is 2048 B" in str(info.value)
    # No offload: the model's shards alone exceed the limit; building fails, not training.
    torch.manual_seed(0)
    with pytest.raises(DeviceMemoryExceeded, match="limit is 24576 B"):
        GeminiDDP(Net(hidden=32, vocab=32, depth=8), precision="fp32",
                  chunk_config_dict={"chunk_size": 1100}, device_memory_limit=limit)


@distributed_test(4)
def test_gemini_ddp_world4_unused_on_some_ranks(rank: int, world_size: int) -> None:
    # World 4, bf16, the auxiliary head reaching the loss on ranks 0 and 2 only.
    ids = _batch(world_size)
    model, ref_model = _make()
    ddp = GeminiDDP(model, precision="bf16", chunk_config_dict=CHUNK)
    _step(ddp, ids, rank, world_size, use_aux=rank in (0, 2))
    _check_grads(ddp, _reference(ref_model, ids, world_size, aux_ranks={0, 2}), 4e-2, 4e-2,
                 "world 4")
