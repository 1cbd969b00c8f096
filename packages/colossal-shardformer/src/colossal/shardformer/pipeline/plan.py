"""Pipeline stages as data: which modules the first and last stage own, and how.

A :class:`StagePlan` describes one family's base model (paths relative to it):

* ``first``: the modules only the first stage holds (embeddings), each with the placeholder
  kind the other stages put in their place (see :mod:`.placeholders`);
* ``layers``: the stack of repeated layers cut between the stages;
* ``last``: the modules only the last stage holds (final norm), with their kinds elsewhere;
* ``feed``: the forward keyword a non-first stage sets to the received hidden state when the
  original input is not passed on (ViT's ``pixel_values``); ``None``: the microbatch's own
  keywords (``input_ids``, masks, ...) travel with the hidden state and the ``"input"``
  placeholder returns the hidden state where the embedding was;
* ``first_stage_only``: keywords only the first stage reads (not passed to later stages);
* ``dtype_probes``: ``{module: attribute}`` weights whose dtype the forward reads on a module
  the stage does not hold (a zero-size buffer of that dtype is exposed there).

The head model's own modules (``lm_head``, ``score``, ``classifier``, ``cls``) belong to the
last stage and are ``"absent"`` on the others (they are never called there). Plans are written
in the policies for GPT-2, BERT, ViT, OPT and Bloom and derived by :func:`derive_stage_plan`
from ``config.base_model_pp_plan`` (plus the head's ``_pp_plan``) for the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from colossal.shardformer.pipeline.placeholders import PLACEHOLDER_KINDS

__all__ = ["DEFAULT_FIRST_STAGE_ONLY", "StagePlan", "derive_stage_plan"]

logger = logging.getLogger(__name__)

DEFAULT_FIRST_STAGE_ONLY = ("inputs_embeds", "pixel_values", "token_type_ids", "bool_masked_pos")
"""Keywords the embeddings consume; later stages do not receive them."""


@dataclass(frozen=True)
class StagePlan:
    """How a family's base model is cut into pipeline stages (see the module docstring).

    Attributes:
        layers: Path of the layer stack relative to the base model (``"h"``, ``"layers"``).
        first: First-stage module path -> placeholder kind on the other stages.
        last: Last-stage module path -> placeholder kind on the other stages.
        feed: Keyword that carries the received hidden state into a non-first stage's
            forward, or None (the microbatch's keywords are passed on).
        first_stage_only: Keywords only the first stage reads.
        dtype_probes: Module path -> dotted weight path whose dtype the forward reads.

    Raises:
        ValueError: An unknown placeholder kind or an empty layer path.
    """

    layers: str
    first: dict[str, str] = field(default_factory=dict)
    last: dict[str, str] = field(default_factory=dict)
    feed: str | None = None
    first_stage_only: tuple[str, ...] = DEFAULT_FIRST_STAGE_ONLY
    dtype_probes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise ValueError(f"StagePlan.layers must name the layer stack, got {self.layers!r}")
        for where in ("first", "last"):
            for path, kind in getattr(self, where).items():
                if kind not in PLACEHOLDER_KINDS:
                    raise ValueError(
                        f"StagePlan.{where}[{path!r}] = {kind!r} is not a placeholder kind "
                        f"{PLACEHOLDER_KINDS}"
                    )
        overlap = set(self.first) & set(self.last)
        if overlap:
            raise ValueError(f"StagePlan: {sorted(overlap)} are in both first and last")


def base_model_of(model: nn.Module) -> tuple[str, nn.Module]:
    """``(path, module)`` of ``model``'s base model (``("", model)`` when it is one)."""
    base = getattr(model, "base_model", model)
    if not isinstance(base, nn.Module) or base is model:
        return "", model
    for name, child in model.named_children():
        if child is base:
            return name, base
    path = next((n for n, m in model.named_modules() if m is base), "")
    return path, base if path else model


def derive_stage_plan(model: nn.Module) -> StagePlan:
    """The stage plan of a transformers model from its ``config.base_model_pp_plan``.

    The plan's keys are in forward order: the first that names an ``nn.ModuleList`` is the
    layer stack; those before it belong to the first stage (``"input"`` placeholders: they
    produce the hidden state the other stages receive), those after it to the last stage
    (``"identity"`` placeholders). Base-model modules the plan does not name (rotary tables)
    stay on every stage.

    Raises:
        ValueError: No ``base_model_pp_plan`` naming a layer stack; the message says how to
            give a plan.
    """
    config = getattr(model, "config", None)
    pp_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    _, base = base_model_of(model)
    layers = None
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    for key in pp_plan:
        try:
            module = base.get_submodule(key)
        except AttributeError:
            continue
        if layers is None and isinstance(module, nn.ModuleList):
            layers = key
        elif layers is None:
            first[key] = "input"
        else:
            last[key] = "identity"
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: its config has no base_model_pp_plan naming the layer "
            "stack, so no pipeline stage plan can be derived; write one in a policy "
            "(override Policy.stage_plan() to return a colossal.shardformer.pipeline.StagePlan)"
        )
    return StagePlan(layers=layers, first=first, last=last)
