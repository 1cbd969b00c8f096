"""The model, the data and the PyTorch-native peers of ``benchmarks/hybrid.py``.

* TP2 x DP2: DTensor tensor parallelism (``parallelize_module`` on the ``tp`` dimension of a
  2-D ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``) with data
  parallelism over ``dp``: FSDP2 ``fully_shard`` on the ``dp`` sub-mesh (every decoder layer,
  then the root; ``reshard_after_forward=False``: no all-gather in the backward) or DDP over
  the ``dp`` group (after ``_pre_dp_module_transform``, torch's hook that lets DDP hold
  DTensor parameters as local tensors).
* PP2 x DP2: ``torch.distributed.pipelining`` -- a manual ``PipelineStage`` split of the
  Llama layers (stage 0: embedding + first half; stage 1: second half + norm + LM head),
  ``Schedule1F1B`` with the microbatches of ours, and DDP over the ``dp`` group (the
  schedule runs all but the last microbatch's backward under ``no_sync``); should DDP fail,
  a flat all-reduce of the stage's gradients over ``dp`` after the schedule instead.
"""

from __future__ import annotations

from typing import Any

import torch
from shardformer import build_model, tp_plan  # the same Llama model and plan
from torch import nn
from torch.nn import functional as F  # noqa: N812

FULL = {
    "hidden": 768,
    "layers": 6,
    "heads": 12,
    "kv_heads": 4,
    "intermediate": 2048,
    "vocab": 8192,
    "batch": 8,
    "seq": 128,
}
QUICK = {
    "hidden": 256,
    "layers": 4,
    "heads": 4,
    "kv_heads": 4,
    "intermediate": 704,
    "vocab": 2048,
    "batch": 8,
    "seq": 64,
}
LR = 1e-4


def num_params(size: dict[str, int]) -> int:
    """Parameters of the model (built on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(size).parameters())


def global_batch(size: dict[str, int], step: int) -> torch.Tensor:
    """Random token ids of the whole (global) batch of ``step``: ``(batch, seq)``."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)


def dp_rows(ids: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's equal block of rows."""
    n = ids.shape[0] // dp_size
    return ids[dp_rank * n : (dp_rank + 1) * n]


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (other tensors as they are)."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor | None) -> int:
    t = local(t)
    return 0 if t is None else t.numel() * t.element_size()


def model_state_bytes(params: list[torch.Tensor], optim: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer states (DTensor: local)."""
    unique = list({id(p): p for p in params}.values())
    states = sum(
        _nbytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    params_b = sum(_nbytes(p) for p in unique)
    grads_b = sum(_nbytes(p.grad) for p in unique)
    return {"params": params_b, "grads": grads_b, "optimizer_states": states,
            "total": params_b + grads_b + states}  # fmt: skip


# --------------------------------------------------------------------------------------------
# TP2 x DP2


def torch_tp_dp(model: nn.Module, dp_kind: str) -> tuple[nn.Module, Any]:
    """``model`` tensor-parallel over ``tp`` and data-parallel over ``dp`` (``fsdp2``/``ddp``).

    Returns the module to call and the 2-D device mesh.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(model, mesh["tp"], tp_plan(model))
    if dp_kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
        return model, mesh
    if dp_kind == "ddp":
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
        return nn.parallel.DistributedDataParallel(
            model, process_group=mesh.get_group("dp"), gradient_as_bucket_view=True
        ), mesh
    raise ValueError(f"dp_kind={dp_kind!r}: choose 'fsdp2' or 'ddp'")


def tp_loss(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face's loss on sharded logits, under ``loss_parallel`` (call backward inside)."""
    return module(input_ids=ids, labels=ids, use_cache=False).loss


# --------------------------------------------------------------------------------------------
# PP2 x DP2


class _Stage(nn.Module):
    """A run of Llama decoder layers (with the embedding first, or norm + LM head last)."""

    def __init__(self, model: nn.Module, first: bool, lo: int, hi: int) -> None:
        super().__init__()
        base = model.model
        self.first = first
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleList(base.layers[lo:hi])
        self.rotary_emb = base.rotary_emb
        self.norm = None if first else base.norm
        self.lm_head = None if first else model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:  # no mask: SDPA's is_causal path, as in the full model
            h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=pos,
                      past_key_values=None, use_cache=False)  # fmt: skip
        if self.first:
            return h
        return self.lm_head(self.norm(h))


def pp_stage_module(model: nn.Module, stage: int) -> nn.Module:
    """Stage ``stage`` (0 or 1) of a 2-stage split of ``model`` (half of the layers each)."""
    if stage not in (0, 1):
        raise ValueError(f"benchmark peer: stage {stage}, only 2 stages are built")
    n = len(model.model.layers)
    lo, hi = (0, n // 2) if stage == 0 else (n // 2, n)
    return _Stage(model, stage == 0, lo, hi)


def pp_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (what ``LlamaForCausalLM`` computes with ``labels=ids``)."""
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


class TorchPipeline:
    """``PipelineStage`` + ``Schedule1F1B`` over ``pp``, data parallel over ``dp``.

    ``dp_kind="ddp"``: the stage module wrapped in DDP (the schedule runs every backward but
    the last under ``no_sync``). ``"allreduce"`` (the fallback when DDP cannot run): after the
    schedule, one flat all-reduce of the stage's gradients over ``dp``, averaged.
    """

    def __init__(self, model: nn.Module, microbatches: int, dp_kind: str = "ddp") -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        if dp_kind not in ("ddp", "allreduce"):
            raise ValueError(f"dp_kind={dp_kind!r}: choose 'ddp' or 'allreduce'")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        self.stage = mesh.get_local_rank("pp")
        self.dp_rank = mesh.get_local_rank("dp")
        self.dp_group = mesh.get_group("dp")
        self.module = pp_stage_module(model, self.stage)
        self.dp_kind = dp_kind
        runs: nn.Module = self.module
        if dp_kind == "ddp":
            runs = nn.parallel.DistributedDataParallel(
                self.module, process_group=self.dp_group, gradient_as_bucket_view=True
            )
        self.pipe_stage = PipelineStage(
            runs, self.stage, 2, torch.device("cpu"), group=mesh.get_group("pp")
        )
        self.schedule = Schedule1F1B(self.pipe_stage, microbatches, loss_fn=pp_loss)

    def _average_grads(self) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)

    def run(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every microbatch; the mean loss on the last stage."""
        losses: list[torch.Tensor] = []
        if self.stage == 0:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=ids, losses=losses)
        if self.dp_kind == "allreduce":
            self._average_grads()
        return torch.stack([x.detach() for x in losses]).mean() if losses else None
