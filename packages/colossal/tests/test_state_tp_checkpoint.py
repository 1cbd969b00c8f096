"""Tensor-parallel checkpoints: saved whole and unpadded at TP 2, loaded at TP 4 and unsharded.

The models are Hugging Face ones whose parameters are replaced, by hand, with the parts a
tensor-parallel rank holds (:func:`colossal.core.shard_parameter`, exactly what the parallel
layers build): Llama's column/row-parallel projections and tied, padded vocabulary; GPT-2's
fused q/k/v ``Conv1D`` (a :class:`colossal.core.Blocks` part) and tied, padded vocabulary. The
checkpoint IO only sees the parts, so this tests it without the layers' forward.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from colossal.checkpoint_io import CheckpointIO
from colossal.core import Block, Blocks, OptimizerWrapper, shard_parameter, shard_spec, sharded_view
from colossal.core.testing import assert_rel_close, spawn

FAMILIES = ("llama", "gpt2")
VOCAB = 100  # padded to 128 at TP 2 and 256 at TP 4: ranks 2 and 3 hold only padding
JUNK = 7.0  # gradients of padding: would reach files and states if padding leaked


def build(family: str, seed: int = 0) -> nn.Module:
    """A tiny causal LM of ``family`` with tied embeddings, initialized from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=16,
            tie_word_embeddings=True,
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,  # no dropout: the grad-norm check compares a forward and backward
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def _split(n: int, rank: int, tp: int) -> tuple[int, int]:
    return rank * n // tp, (rank + 1) * n // tp


def _along(t: torch.Tensor, dim: int, rank: int, tp: int) -> Block:
    return Block.along(t.shape, dim, *_split(t.shape[dim], rank, tp))


def _fused(t: torch.Tensor, dim: int, rank: int, tp: int, n: int = 3) -> Blocks:
    seg = t.shape[dim] // n
    lo, hi = _split(seg, rank, tp)
    return Blocks(
        dim, tuple(Block.along(t.shape, dim, s * seg + lo, s * seg + hi) for s in range(n))
    )


def _vocab(
    t: torch.Tensor, rank: int, tp: int, divisible_by: int = 64
) -> tuple[Block, tuple[int, ...]]:
    multiple = divisible_by * tp
    padded = -(-t.shape[0] // multiple) * multiple
    rows = padded // tp
    lo, hi = min(t.shape[0], rank * rows), min(t.shape[0], (rank + 1) * rows)
    return Block.along(t.shape, 0, lo, hi), (rows, *t.shape[1:])


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def plan(
    model: nn.Module, rank: int, tp: int
) -> dict[str, tuple[Block | Blocks, tuple[int, ...] | None]]:
    """Parameter name -> (part this rank holds, local shape when padded) for a TP layout."""
    out: dict[str, tuple[Block | Blocks, tuple[int, ...] | None]] = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        w = getattr(module, "weight", None)
        if leaf in ("embed_tokens", "wte"):
            out[f"{name}.weight"] = _vocab(w, rank, tp)
        elif leaf in COLUMN or leaf == "c_fc":
            dim = 1 if leaf == "c_fc" else 0  # Conv1D stores (in, out)
            out[f"{name}.weight"] = (_along(w, dim, rank, tp), None)
            if module.bias is not None:
                out[f"{name}.bias"] = (_along(module.bias, 0, rank, tp), None)
        elif leaf in ROW or leaf == "c_proj":
            dim = 0 if leaf == "c_proj" else 1
            out[f"{name}.weight"] = (_along(w, dim, rank, tp), None)  # bias replicated
        elif leaf == "c_attn":
            out[f"{name}.weight"] = (_fused(w, 1, rank, tp), None)
            out[f"{name}.bias"] = (_fused(module.bias, 0, rank, tp), None)
    return out


def shard_by_hand(model: nn.Module, rank: int, tp: int, group: Any = None) -> nn.Module:
    """Replace ``model``'s parameters with this rank's TP parts (tied weights stay tied)."""
    made: dict[int, nn.Parameter] = {}
    layout = plan(model, rank, tp)
    for module_name, module in list(model.named_modules()):
        for leaf, param in list(module.named_parameters(recurse=False)):
            if id(param) in made:
                setattr(module, leaf, made[id(param)])
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            if name not in layout:
                continue
            part, local_shape = layout[name]
            made[id(param)] = shard_parameter(param, part, group, local_shape)
            setattr(module, leaf, made[id(param)])
    return model


def full_grads(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """A fixed gradient for every parameter (by name, whole shapes)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        spec = shard_spec(p)
        out[name] = torch.randn(p.shape if spec is None else spec.shape, generator=gen)
    return out


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Each parameter's part of ``grads``; padding gets :data:`JUNK`."""
    for name, p in model.named_parameters():
        view = sharded_view(p.detach(), like=p)
        if view is None:
            p.grad = grads[name].clone()
            continue
        p.grad = torch.full_like(p, JUNK)
        view.part.real(p.grad).copy_(view.part.take(grads[name]))


def make_optimizer(model: nn.Module) -> OptimizerWrapper:
    names, params = zip(*model.named_parameters(), strict=True)
    return OptimizerWrapper(torch.optim.Adam(params, lr=0.1), [list(names)])


def step(model: nn.Module, optimizer: OptimizerWrapper, seed: int = 1) -> None:
    """One Adam step with the fixed gradients (``seed``)."""
    set_grads(model, full_grads(model, seed))
    optimizer.step()
    optimizer.zero_grad()


def reference(family: str, steps: int = 1) -> tuple[nn.Module, OptimizerWrapper]:
    """The unsharded model after ``steps`` steps (seeds 1, 2, ...)."""
    model = build(family)
    optimizer = make_optimizer(model)
    for s in range(steps):
        step(model, optimizer, s + 1)
    return model, optimizer


def gathered(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    view = sharded_view(t, like=like)
    return t if view is None else view.gather()


def _check_equal(model: nn.Module, optimizer: Any, ref: nn.Module, ref_opt: Any, what: str) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = gathered(p.detach(), p)
        assert torch.equal(full, ref_params[name].detach()), f"{what}: parameter {name}"
    ref_state = {id(p): ref_opt.state[p] for p in ref.parameters()}
    by_name = {n: id(p) for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        mine, theirs = optimizer.state[p], ref_state[by_name[name]]
        assert set(mine) == set(theirs), f"{what}: state keys of {name}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == p.shape, f"{what}: {name}.{key} not laid out like it"
            assert torch.equal(gathered(mine[key], p), theirs[key]), f"{what}: {name}.{key}"


def has_shardformer() -> bool:
    """Whether ``colossal.shardformer`` provides ShardFormer (its framework has landed)."""
    try:
        from colossal.shardformer.shard import ShardConfig, ShardFormer  # noqa: F401
    except ImportError:
        return False
    return True


def shard(model: nn.Module, how: str, rank: int, tp: int) -> nn.Module:
    """``model`` sharded over the whole job: by hand, or end to end by ShardFormer."""
    if how == "hand":
        return shard_by_hand(model, rank, tp)
    from colossal.shardformer.shard import ShardConfig, ShardFormer

    return ShardFormer(ShardConfig(tensor_parallel_process_group=None)).optimize(model)[0]


def _batch(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _check_grad_norm(rank: int, world_size: int, family: str) -> None:
    """Real TP gradients: core's grad_norm equals torch's norm of the unsharded model's."""
    from colossal.core import clip_grad_norm_

    ids = _batch()
    ref = build(family)
    ref(input_ids=ids, labels=ids).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    model = shard(build(family), "shardformer", rank, world_size)
    model(input_ids=ids, labels=ids).loss.backward()
    got = clip_grad_norm_(model.parameters(), 1e9)
    assert_rel_close(got, expected, 1e-5)


def _save_tp(rank: int, world_size: int, root: str, flavors: tuple[str, ...]) -> None:
    for how in flavors:
        for family in FAMILIES:
            if how == "shardformer":
                _check_grad_norm(rank, world_size, family)
            model = shard(build(family), how, rank, world_size)
            optimizer = make_optimizer(model)
            step(model, optimizer, 1)
            ref, ref_opt = reference(family)
            _check_equal(model, optimizer, ref, ref_opt, f"{how} TP {world_size} training")
            io = CheckpointIO()
            directory = os.path.join(root, how, family)
            io.save_model(model, directory, shard=True, size_per_shard=0.002)
            io.save_optimizer(optimizer, directory, shard=True, size_per_shard=0.002)


def _check_lazy(rank: int, world_size: int, family: str) -> None:
    """Lazy init, ShardFormer, materialize: only this rank's part, equal to eager + ShardFormer."""
    from colossal.lazy import LazyInitContext

    eager = shard(build(family), "shardformer", rank, world_size)
    with LazyInitContext():
        lazy = build(family)
    lazy = shard(lazy, "shardformer", rank, world_size)
    assert all(p.is_meta for p in lazy.parameters())
    LazyInitContext.materialize(lazy)
    eager_params = dict(eager.named_parameters(remove_duplicate=False))
    for name, p in lazy.named_parameters(remove_duplicate=False):
        assert p.shape == eager_params[name].shape, f"lazy {family}: {name} shape"
        assert torch.equal(p, eager_params[name]), f"lazy {family}: {name}"
        assert (shard_spec(p) is None) == (shard_spec(eager_params[name]) is None), name


def _load_tp(rank: int, world_size: int, root: str, flavors: tuple[str, ...]) -> None:
    for how in flavors:
        for family in FAMILIES:
            if how == "shardformer":
                _check_lazy(rank, world_size, family)
            model = shard(build(family, seed=5), how, rank, world_size)  # other values
            optimizer = make_optimizer(model)
            step(model, optimizer, 9)  # other states, to be overwritten
            io = CheckpointIO()
            directory = os.path.join(root, how, family)
            io.load_model(model, directory)
            io.load_optimizer(optimizer, directory)
            ref, ref_opt = reference(family)
            _check_equal(model, optimizer, ref, ref_opt, f"{how} TP {world_size} load")
            # The loaded (padded) states train on: a second step equals the reference's.
            step(model, optimizer, 2)
            step(ref, ref_opt, 2)
            _check_equal(model, optimizer, ref, ref_opt, f"{how} TP {world_size} next step")
    dist.barrier()


def test_tp2_checkpoint_loads_at_tp4_unsharded_and_from_pretrained(tmp_path: Any) -> None:
    """Catches: local (padded) shards written under HF names, only rank 0's part saved, Blocks
    read as one block, optimizer states saved padded or loaded unpadded, a rank holding only
    padding reading past the tensor, tied weights saved twice. With ShardFormer (end to end):
    also its real gradients' global norm (TP 2) and lazy init materializing parts (TP 4)."""
    import transformers

    root = str(tmp_path)
    flavors = ("hand", "shardformer") if has_shardformer() else ("hand",)
    spawn(_save_tp, 2, args=(root, flavors))
    spawn(_load_tp, 4, args=(root, flavors))
    for how, family in ((h, f) for h in flavors for f in FAMILIES):
        directory = os.path.join(root, how, family)
        ref, ref_opt = reference(family)
        expected = ref.state_dict()
        # Files: whole, unpadded Hugging Face tensors, each tied weight once.
        stored: dict[str, torch.Tensor] = {}
        for file in os.listdir(directory):
            if file.startswith("model") and file.endswith(".safetensors"):
                with safe_open(os.path.join(directory, file), framework="pt") as handle:
                    stored.update({k: handle.get_tensor(k) for k in handle.keys()})  # noqa: SIM118
        assert "lm_head.weight" not in stored  # tied to the embedding: saved once
        assert set(stored) == set(expected) - {"lm_head.weight"}
        for name, tensor in stored.items():
            assert torch.equal(tensor, expected[name]), f"{family}: file tensor {name}"
        # Unsharded load into a plain model and its optimizer.
        plain = build(family, seed=5)
        plain_opt = make_optimizer(plain)
        step(plain, plain_opt, 9)
        io = CheckpointIO()
        io.load_model(plain, directory)
        io.load_optimizer(plain_opt, directory)
        _check_equal(plain, plain_opt, ref, ref_opt, "unsharded load")
        # Hugging Face reads the directory.
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory)
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, expected[name]), f"{family}: from_pretrained {name}"
