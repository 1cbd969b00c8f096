"""Expert-parallel stand-in for a Hugging Face fused experts module (``MixtralExperts`` & co).

transformers 5 stores a MoE layer's experts as fused 3-D parameters: ``gate_up_proj``
``[E, 2F, H]`` and ``down_proj`` ``[E, H, F]`` (``is_transposed``: ``[E, H, 2F]`` and
``[E, F, H]``; ``has_bias``: ``gate_up_proj_bias`` ``[E, 2F]``, ``down_proj_bias`` ``[E, H]``),
and the MoE block calls ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights
[T, k])``. :class:`HFExpertParallelExperts` keeps this rank's ``E / ep`` experts' slices of those
parameters (same names, so checkpoints and optimizer aliases keep their keys), marks them sharded
over ``"ep"`` on dim 0, and computes the same mixture with :func:`dispatch` / :func:`combine`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from colossal.shardformer.moe.dispatch import combine, dispatch, ep_size
from colossal.shardformer.moe.modules import _mark_ep, local_expert_range
from colossal.shardformer.moe.routing import RoutingResult

__all__ = ["HFExpertParallelExperts", "fused_layout_problem"]

_WEIGHTS = ("gate_up_proj", "down_proj")
_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def fused_layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not a fused experts module this file can run; None when it is.

    Supported: Hugging Face's default gated layout (``act(gate) * up`` with ``gate_up_proj``
    holding ``[gate; up]``), plain or transposed weights, with or without biases.
    """
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or num_experts < 1:
        return "it has no integer num_experts"
    params = dict(module.named_parameters(recurse=False))
    for name in _WEIGHTS:
        p = params.get(name)
        if p is None or p.dim() != 3 or p.shape[0] != num_experts:
            return f"it has no 3-D {name} with {num_experts} experts on dim 0"
    extra = set(params) - set(_WEIGHTS) - set(_BIASES)
    if extra:
        return f"it has parameters {sorted(extra)} besides {list(_WEIGHTS + _BIASES)}"
    if not callable(getattr(module, "act_fn", None)):
        return "it has no act_fn"
    if not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
        return "its gate_up_proj is not the concatenated [gate; up] layout"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes after each expert"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return "it has its own _apply_gate"
    return None


class HFExpertParallelExperts(nn.Module):
    """This rank's experts of a Hugging Face fused experts module, run expert-parallel.

    ``forward(hidden_states, top_k_index, top_k_weights)`` returns ``[T, H]`` with
    ``y[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` for ``e = top_k_index[t, j]``
    (an index equal to ``E`` is skipped, as in Hugging Face's loop), the tokens travelling to the
    rank holding ``e`` (rank ``e // (E / ep)``) with one counts all-to-all and one uneven token
    all-to-all each way. Every local expert runs every step (on zero rows when it gets no token),
    so each parameter gets a gradient, zero for a starved expert.

    Expert gradients sum the contributions of the tokens of every rank of the ep group; with
    data parallelism over those ranks divide them by ``ep`` (after averaging over the ranks
    holding the same experts) to get the data-parallel mean.

    Args:
        source: The whole fused experts module (all ``E`` experts; meta tensors are fine).
        ep_group: Expert-parallel group (None: every expert local, no communication).

    Raises:
        ValueError: ``source`` has an unsupported layout, or ``ep`` does not divide ``E``.
    """

    def __init__(self, source: nn.Module, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        problem = fused_layout_problem(source)
        if problem is not None:
            raise ValueError(
                f"{type(source).__name__} cannot run expert-parallel: {problem}; supported is "
                "Hugging Face's fused gated experts layout (MixtralExperts, Qwen2/3-MoE, "
                "DeepSeek-V3)"
            )
        num_experts = int(getattr(source, "num_experts"))  # noqa: B009 (checked above)
        ep = ep_size(ep_group)
        if num_experts % ep:
            raise ValueError(
                f"{type(source).__name__} has {num_experts} experts, which an ep group of {ep} "
                f"ranks does not divide; pick an ep size dividing {num_experts}"
            )
        start, stop = local_expert_range(num_experts, ep_group)
        self.num_experts = num_experts
        self.first_expert = start
        self.ep_group = ep_group
        self.is_transposed = bool(getattr(source, "is_transposed", False))
        act_fn = getattr(source, "act_fn")  # noqa: B009 (checked callable above)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = act_fn
        for name, p in source.named_parameters(recurse=False):
            local = nn.Parameter(p.detach()[start:stop].clone(), requires_grad=p.requires_grad)
            _mark_ep(local, num_experts, ep_group)
            self.register_parameter(name, local)
        self.has_bias = hasattr(self, _BIASES[0])

    @property
    def num_local_experts(self) -> int:
        """Experts held on this rank."""
        return self.num_experts // ep_size(self.ep_group)

    def _per_expert(self, name: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight, bias)`` of each local expert for projection ``name``.

        Unbound once per step: indexing ``weight[e]`` per expert would give each expert a
        zero-filled gradient of the whole ``[E/ep, ...]`` parameter and sum them.
        """
        weights = getattr(self, name).unbind(0)
        bias = getattr(self, f"{name}_bias", None)
        biases = bias.unbind(0) if isinstance(bias, torch.Tensor) else [None] * len(weights)
        return list(zip(weights, biases, strict=True))

    def _project(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out = x @ weight if self.is_transposed else nn.functional.linear(x, weight)
        return out if bias is None else out + bias

    def run_local(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Outputs of tokens grouped by local expert (``counts[e]`` rows for local expert ``e``)."""
        outs = []
        experts = zip(self._per_expert("gate_up_proj"), self._per_expert("down_proj"), strict=True)
        for part, (gate_up, down) in zip(torch.split(tokens, counts), experts, strict=True):
            gate, up = self._project(part, *gate_up).chunk(2, dim=-1)
            outs.append(self._project(self.act_fn(gate) * up, *down))
        return torch.cat(outs, dim=0)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed mixture ``[T, H]`` of ``hidden_states`` ``[T, H]`` (same dtype)."""
        index = top_k_index.long()
        keep = (index >= 0) & (index < self.num_experts)
        routing = RoutingResult(index, top_k_weights, keep, top_k_weights, self.num_experts)
        tokens, state = dispatch(hidden_states, routing, self.ep_group)
        out = combine(self.run_local(tokens, state.local_counts), state)
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        """Global and local experts."""
        return (
            f"num_experts={self.num_experts}, local=[{self.first_expert}, "
            f"{self.first_expert + self.num_local_experts})"
        )
