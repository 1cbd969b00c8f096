"""The one stage forward every family shares (the model's own ``forward`` runs inside)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

from colossal.shardformer.pipeline.placeholders import StagePlaceholder
from colossal.shardformer.pipeline.plan import StagePlan

__all__ = ["HIDDEN_KEY", "StageForward"]

HIDDEN_KEY = "hidden_states"
"""The key of the hidden state in the dict a non-last stage returns."""


def _parameters(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


class StageForward:
    """A model chunk's instance-level ``forward``: the stage's part of the model.

    The first slice is called with the microbatch (``input_ids``, ``attention_mask``,
    ``labels``, ``pixel_values``, ...); later slices with the previous slice's output dict.
    A non-last slice runs the base model and returns ``{"hidden_states": last_hidden_state,
    **pass_through}`` (every tensor keyword later slices need: masks, labels, position ids,
    ``input_ids`` when the plan passes the microbatch on). The last slice runs the head
    model's own ``forward`` and returns its usual output (with ``.loss`` given ``labels``).

    Args:
        chunk: The model chunk (a shallow copy of the transformers model).
        plan: Its family's stage plan.
        base_path: Path of the base model inside ``chunk`` (``""``: the chunk is one).
        is_first: Whether the chunk holds the model's first slice.
        is_last: Whether it holds the last slice.
        inputs: The ``"input"`` placeholders that return the received hidden state.
    """

    def __init__(
        self,
        chunk: nn.Module,
        plan: StagePlan,
        base_path: str,
        is_first: bool,
        is_last: bool,
        inputs: list[StagePlaceholder],
    ) -> None:
        self.chunk = chunk
        self.plan = plan
        self.base_path = base_path
        self.is_first = is_first
        self.is_last = is_last
        self.inputs = inputs
        cls = type(chunk)
        self._head_params = _parameters(cls.forward)
        base = chunk.get_submodule(base_path) if base_path else chunk
        self._base_params = _parameters(type(base).forward)

    def _call(self, forward_params: set[str], fn: Any, kwargs: dict[str, Any]) -> Any:
        if "use_cache" in forward_params:
            kwargs.setdefault("use_cache", False)  # no cache in a pipelined training step
        return fn(**kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run this stage on keywords (see the class docstring)."""
        if args:
            raise TypeError(
                f"a pipeline stage of {type(self.chunk).__name__} takes keyword arguments only "
                f"(the microbatch dict, or the previous stage's output dict), got {len(args)} "
                "positional"
            )
        stack = contextlib.ExitStack()
        if not self.is_first:
            if HIDDEN_KEY not in kwargs:
                raise TypeError(
                    f"stage of {type(self.chunk).__name__} after the first needs the previous "
                    f"stage's {HIDDEN_KEY!r}, got keywords {sorted(kwargs)}"
                )
            hidden = kwargs.pop(HIDDEN_KEY)
            if self.plan.feed is not None:
                kwargs[self.plan.feed] = hidden
            elif "input_ids" not in kwargs:
                kwargs["inputs_embeds"] = hidden  # the embedding is skipped by the model
            for placeholder in self.inputs:
                stack.enter_context(placeholder.receive(hidden))
        with stack:
            if self.is_last:
                fn = type(self.chunk).forward.__get__(self.chunk)
                return self._call(self._head_params, fn, kwargs)
            base = self.chunk.get_submodule(self.base_path) if self.base_path else None
            fn = base.__call__ if base is not None else type(self.chunk).forward.__get__(self.chunk)
            base_kwargs = {k: v for k, v in kwargs.items() if k in self._base_params}
            out = self._call(self._base_params, fn, base_kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        drop = set(self.plan.first_stage_only)
        if self.plan.feed is not None:
            drop.add(self.plan.feed)
        passed = {
            k: v
            for k, v in kwargs.items()
            if isinstance(v, torch.Tensor) and k not in drop and k != "use_cache"
        }
        return {HIDDEN_KEY: hidden, **passed}
