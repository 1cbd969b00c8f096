"""Shared cases of the attention sequence-parallel modes (``all_to_all``, ``ring_attn``).

The tiny fp32 models (from ``_families``) of every family whose attention goes through
transformers' ``AttentionInterface`` (GPT-2, BERT, ViT, OPT; Llama and Qwen2 through their
derived policies), :func:`reference_attention` (SDPA over the whole sequence, the reference
of the ring and Ulysses attentions alone), and :func:`check_family`: ``reference_check``
with the mode on, ``SequenceParallelGradSync`` after each backward, everything at relative
error <= 1e-5.

A causal LM with ``parallel_output=True`` returns this rank's tokens' logits (layout order):
:func:`full_logits` places every rank's logits at their ``token_indices`` so they compare
with the unsharded model's whole logits (which proves each rank's logits are the reference
at its token indices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# The tiny models live in ``_families``; re-exported for the SP tests (``c.gpt2()``, ...).
from _families import bert, bloom, derived, gpt2, opt, vit  # noqa: F401

RTOL = 1e-5


def batch(pad: bool = True, seq_len: int = 8) -> dict[str, torch.Tensor]:
    """A causal LM batch (row 1 left-padded when ``pad``)."""
    from _families import lm_batch

    return lm_batch(pad=pad, seq_len=seq_len)


def mlm(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``b`` with every other label ignored (a masked-LM batch)."""
    from _families import masked_lm

    return masked_lm(b)


def pixels() -> dict[str, torch.Tensor]:
    """Two 12x12 images and their labels."""
    from _families import images

    return images()


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, causal: bool
) -> torch.Tensor:
    """SDPA over the whole sequence: the single-process reference of the SP attentions.

    ``k`` / ``v`` may hold fewer heads (grouped-query attention: repeated here); ``mask`` is
    None, a 2-D padding mask (combined with the causal mask when ``causal``) or a 4-D mask.
    """
    from torch.nn import functional as F  # noqa: N812

    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if mask.dim() == 2:
        keep = mask.bool()[:, None, None, :]
        if causal:
            s = q.shape[2]
            keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def reference_case(
    seed: int,
    mask: Any,
    causal: bool,
    hk: int = 4,
    shape: tuple[int, int, int, int] = (2, 4, 16, 8),
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Random q, k, v of one whole sequence and their :func:`reference_attention`.

    ``shape`` is ``(batch, query heads, sequence, head dim)``; k and v have ``hk`` heads.
    Returns ``(full, w, ref)``: the q, k, v leaves (their ``.grad`` is the gradient of
    ``(ref * w).sum()``), the random output weight ``w`` and the output ``ref``.
    """
    b, hq, s, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for h in (hq, hk, hk))
    w = torch.randn(b, hq, s, d, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, mask, causal)
    (ref * w).sum().backward()
    return full, w, ref


def check_slice(
    out: torch.Tensor, local: list[torch.Tensor], full: list[torch.Tensor], ref: torch.Tensor,
    mine: torch.Tensor, what: str,
) -> None:  # fmt: skip
    """A rank's output and q/k/v gradients equal the reference's at its tokens ``mine``."""
    from colossal.core.testing import relative_error

    errors = {"out": relative_error(out, ref[:, :, mine])}
    for label, got, want in zip("qkv", local, full, strict=True):
        errors[f"d{label}"] = relative_error(got.grad, want.grad[:, :, mine])
    bad = {key: e for key, e in errors.items() if not e <= RTOL}
    assert not bad, f"{what}: {bad}"


def sync(model: torch.nn.Module) -> None:
    """Sum the partial gradients of the sequence-parallel parameters."""
    from colossal.shardformer import SequenceParallelGradSync

    SequenceParallelGradSync(model)()


def sp_kwargs(mode: str, sp_group: Any = None, tp_group: Any = None) -> dict[str, Any]:
    """``ShardConfig`` arguments of ``mode`` (tensor parallelism only with ``tp_group``)."""
    return {
        "enable_sequence_parallelism": True,
        "sequence_parallelism_mode": mode,
        "sequence_parallel_process_group": sp_group,
        "tensor_parallel_process_group": tp_group,
        "enable_tensor_parallelism": tp_group is not None,
    }


ZERO_GRAD_SUFFIXES = ("key.bias", "k_proj.bias")
"""Key biases: softmax ignores them, their exact gradient is 0 (compared absolutely)."""


def full_logits(logits: torch.Tensor, seq_len: int, state: Any) -> torch.Tensor:
    """The whole sequence's logits from every rank's ``(b, seq / P, ...)`` logits.

    Each rank's logits go to the global positions ``token_indices`` names for it in the
    model's layout (its sequence-parallel state). Not differentiable (the loss is the
    objective of these checks).
    """
    import torch.distributed as dist

    from colossal.shardformer.sequence import token_indices

    size = dist.get_world_size(state.group)
    pieces = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(pieces, logits.detach().contiguous(), group=state.group)
    full = logits.new_empty((logits.shape[0], seq_len, *logits.shape[2:]))
    for r, piece in enumerate(pieces):
        full[:, token_indices(seq_len, r, size, state.layout)] = piece
    return full


def gathering(build: Callable[[], Any], seen: list[bool]) -> Callable[[], Any]:
    """``build`` whose model puts the whole sequence's logits in its output when they are local.

    Appends to ``seen`` whether the logits were this rank's tokens only (the sharded head).
    """

    def hooked() -> Any:
        model = build()

        def whole(mod: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
            from colossal.shardformer.sequence import get_sequence_state

            state = get_sequence_state(mod)
            ids = kwargs.get("input_ids")
            logits = getattr(out, "logits", None)
            if state is None or ids is None or logits is None:
                return out
            local = logits.shape[1] != ids.shape[1]
            seen.append(local)
            if local:
                out.logits = full_logits(logits, ids.shape[1], state)
            return out

        model.register_forward_hook(whole, with_kwargs=True)
        return model

    return hooked


def check_family(
    build: Callable[[], Any], b: dict[str, torch.Tensor], what: str, kwargs: dict[str, Any],
    steps: int = 1, local: bool = False,
) -> Any:  # fmt: skip
    """``reference_check`` with the sequence-parallel grad sync; raises naming ``what``.

    ``local``: the sharded model must return this rank's tokens' logits (a causal LM's head
    on sequence shards) instead of the whole sequence's; they are compared at their
    ``token_indices``.

    Key biases (exact gradient 0, so a relative error is rounding noise) are compared by
    their largest absolute difference (gradient after the last backward, parameter after
    the steps; <= 1e-6) instead.
    """
    from _models import reference_check

    from colossal.core import sharded_view

    built: list[Any] = []

    def recording() -> Any:
        built.append(build())
        return built[-1]

    seen: list[bool] = []
    report = reference_check(
        gathering(recording, seen), b, shard_config_kwargs=kwargs, steps=steps, rtol=RTOL,
        check=False, update_rtol=1e-3, after_backward=sync,
    )  # fmt: skip
    if "input_ids" in b:
        assert seen and all(x == local for x in seen), f"{what}: local logits {seen}, want {local}"
    failures = [f for f in report.failures if not f.split(":")[0].endswith(ZERO_GRAD_SUFFIXES)]
    ref, model = built
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if not n.endswith(ZERO_GRAD_SUFFIXES):
            continue
        for label, mine, theirs in (("grad", p.grad, ref_params[n].grad), ("param", p, None)):
            if mine is None:
                continue
            view = sharded_view(mine, like=p)
            full = mine.detach() if view is None else view.gather()
            want = ref_params[n].detach() if theirs is None else theirs
            diff = float((full - want).abs().max())
            if not diff <= 1e-6:
                failures.append(f"{label} {n}: max abs difference {diff:.3e}")
    assert not failures, f"{what}: differs from unsharded:\n" + "\n".join(failures[:20])
    assert report.grads, f"{what}: no gradient was compared"
    return report


def sync_matters(build: Callable[[], Any], b: dict[str, torch.Tensor], kwargs: dict[str, Any],
                 name: str | tuple[str, ...]) -> None:  # fmt: skip
    """Without the grad sync these parameters' gradients are only this rank's share."""
    from _models import reference_check

    report = reference_check(
        gathering(build, []), b, shard_config_kwargs=kwargs, steps=0, check=False
    )
    for n in (name,) if isinstance(name, str) else name:
        assert report.grads[n] > 1e-2, (n, report.grads[n])


def ignored_on_rank0(b: dict[str, torch.Tensor], layout: str, size: int) -> dict[str, torch.Tensor]:
    """``b`` whose shifted labels are all ``-100`` on rank 0's tokens of ``layout``.

    Token ``t`` predicts label ``t + 1``; rank 0 then has no token to count, the others do.
    """
    from colossal.shardformer.sequence import token_indices

    out = dict(b)
    labels = out["labels"].clone()
    s = labels.shape[1]
    targets = token_indices(s, 0, size, layout) + 1
    labels[:, targets[targets < s]] = -100
    out["labels"] = labels
    return out


def head_cases(mode: str, sp_group: Any = None, partial: tuple[str, ...] = ()) -> None:
    """The causal-LM head on sequence shards (Llama), beyond :func:`check_family`'s families.

    * an unpadded causal batch whose shifted labels are all ``-100`` on rank 0's tokens: the
      loss is still the global one (catches a per-rank mean: 0 / 0 on rank 0);
    * ``parallel_output=False``: the whole sequence's logits, as without the sharded head
      (catches the head kept local when the user asked for full logits);
    * without ``SequenceParallelGradSync`` the LM head's and the final norm's gradients are
      only this rank's share (catches them missing from the partial-gradient marks: the
      sync would leave them partial, which the families' checks see too, and shows the
      sync is what makes them whole); ``partial`` names more parameters checked so in the
      same run;
    * ``logits_to_keep=1`` and the base model called directly: the whole sequence's outputs.
    """
    import torch.distributed as dist

    from colossal.shardformer.sequence.attention import sequence_layout

    llama = derived("tiny_llama_config")
    kw = sp_kwargs(mode, sp_group)
    layout = sequence_layout(llama(), mode)
    size = dist.get_world_size(sp_group)
    lone = ignored_on_rank0(batch(pad=False), layout, size)
    check_family(llama, lone, f"Llama {mode}, rank 0 without labels", kw, steps=0, local=True)
    full = {**kw, "parallel_output": False}
    check_family(llama, batch(), f"Llama {mode}, parallel_output=False", full, steps=0)
    sync_matters(llama, batch(), kw, ("lm_head.weight", "model.norm.weight", *partial))
    _whole_outputs(llama, kw)


def _whole_outputs(build: Callable[[], Any], kw: dict[str, Any]) -> None:
    """``logits_to_keep=1`` and a direct call of the base model still see the whole sequence.

    Catches the exit left ungathered outside a whole-model forward that keeps every logit
    (the last token's logits would be a rank's last local token's; the base model's hidden
    states would be half a sequence).
    """
    from colossal.core.testing import relative_error
    from colossal.shardformer import ShardConfig, ShardFormer

    b = {k: v for k, v in batch().items() if k != "labels"}
    torch.manual_seed(0)
    ref = build().eval()
    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig(**kw)).optimize(build().eval())
    with torch.no_grad():
        assert model(**b).logits.shape[1] < b["input_ids"].shape[1]  # local logits first
        got, want = model.model(**b).last_hidden_state, ref.model(**b).last_hidden_state
        assert got.shape == want.shape and relative_error(got, want) <= RTOL, "base model"
        got, want = model(**b, logits_to_keep=1).logits, ref(**b, logits_to_keep=1).logits
        assert got.shape == want.shape and relative_error(got, want) <= RTOL, "logits_to_keep"


def pipeline_cases(mesh: Any) -> None:
    """PP 2 x SP 2 (mesh axes ``"pp"``, ``"sp"``): only the last slice's chunk keeps logits local.

    1F1B with Llama under Ulysses (stage 0 gathers at its stack's exit and sends the whole
    sequence; stage 1 splits it, keeps it local through its head and loss), and ZB-V with
    Qwen2's tied embedding under ring attention (first and last slice are two chunks of
    stage 0 holding one Parameter: the embedding chunk scales its gradient share although
    the head chunk is prepared after it). Loss on the last stage and every gradient, after
    the schedule and ``SequenceParallelGradSync``, equal the unsharded model's.
    """
    import torch.distributed as dist
    from torch import nn

    from colossal.core import sharded_view
    from colossal.core.testing import relative_error
    from colossal.pipeline import (
        OneForwardOneBackwardSchedule,
        PipelineStageManager,
        ZeroBubbleVPipeScheduler,
    )
    from colossal.shardformer import SequenceParallelGradSync, ShardConfig, ShardFormer

    sp = mesh.get_group_along_axis("sp")
    b = batch(pad=False)  # microbatches of equal token counts: their mean is the batch's
    cases = (
        ("Llama 1F1B all_to_all", derived("tiny_llama_config"), "all_to_all", False),
        ("Qwen2 tied ZB-V ring_attn", derived("tiny_qwen2_config", "Qwen2ForCausalLM", layers=4),
         "ring_attn", True),
    )  # fmt: skip
    for what, build, mode, zbv in cases:
        torch.manual_seed(0)
        ref = build().train()
        torch.manual_seed(0)
        model = build().train()
        if zbv:
            sm = PipelineStageManager(mesh, "pp", num_model_chunks=2, use_zbv=True)
        else:
            sm = PipelineStageManager(mesh, "pp")
        config = ShardConfig(pipeline_stage_manager=sm, **sp_kwargs(mode, sp))
        out, shared = ShardFormer(config).optimize(model)
        chunks = list(out) if isinstance(out, nn.ModuleList) else [out]
        if zbv:
            schedule: Any = ZeroBubbleVPipeScheduler(sm, 2, num_microbatches=2,
                                                     shared_params=shared)  # fmt: skip
        else:
            schedule = OneForwardOneBackwardSchedule(sm, num_microbatches=2, shared_params=shared)
        result = schedule.forward_backward_step(
            out, iter([b]), criterion=lambda o, mb: o.loss, return_loss=True
        )
        SequenceParallelGradSync(nn.ModuleList(chunks))()
        ref_loss = ref(**b).loss
        ref_loss.backward()
        last = sm.layout.num_slices - 1
        if any(c._colossal_pipeline_slice == last for c in chunks):
            err = relative_error(result["loss"], ref_loss.detach())
            assert err <= RTOL, f"{what}: loss error {err:.2e}"
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if id(p) in seen or name.endswith(ZERO_GRAD_SUFFIXES):
                    continue
                seen.add(id(p))
                assert p.grad is not None, f"{what}: {name} got no gradient"
                view = sharded_view(p.grad, like=p)
                grad = p.grad if view is None else view.gather()
                err = relative_error(grad, ref_params[name].grad)
                assert err <= RTOL, f"{what} (rank {dist.get_rank()}): grad {name} error {err:.2e}"
