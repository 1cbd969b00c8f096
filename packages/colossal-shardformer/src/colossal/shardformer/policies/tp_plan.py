"""A policy derived from a model's own tensor-parallel plan (``base_model_tp_plan``).

transformers 5.x models carry a plan: ``config.base_model_tp_plan`` for the base model
(``"layers.*.self_attn.q_proj": "colwise"``) and the head class's ``_tp_plan``
(``"lm_head": "colwise_gather_output"``), merged with prefixes on the instance as
``model._tp_plan``. :class:`TPPlanPolicy` turns that plan into a :class:`Policy` (data only,
no forward is rewritten), so every family with a plan works without a hand-written policy.

Styles and the layer each becomes:

====================================  ==================================================
``colwise``                           ``Linear1D_Col`` (output split over heads/features)
``rowwise``                           ``Linear1D_Row`` (one all-reduce)
``colwise_gather_output`` (LM head)   ``VocabParallelLMHead1D`` (``gather_output = not
                                      parallel_output``; vocab-parallel loss otherwise)
``colwise_gather_output`` (other)     ``Linear1D_Col(gather_output=True)``
``rowwise_split_input``               ``Linear1D_Row(parallel_input=False)``
``embedding_rowwise``                 ``VocabParallelEmbedding1D``
``replicated_with_grad_allreduce``    kept; its gradients are all-reduced over the group
====================================  ==================================================

The input embedding becomes ``VocabParallelEmbedding1D`` even when the plan omits it. Other
styles (``packed_colwise``, ``moe_tp_experts``, ``mla_kv_a_proj``, ``local_params``, ...)
raise ``NotImplementedError`` naming the style and the module. Column-parallel siblings
under one parent (q/k/v; gate/up) share one tensor-parallel region at the parent's input
(Megatron's single all-reduce backward) when every parameterized child of the parent is in
the plan.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

if TYPE_CHECKING:
    from colossal.shardformer.grid import GridPlan

from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    Policy,
    PolicyMap,
    SubModuleReplacementDescription,
)

__all__ = ["SUPPORTED_STYLES", "ReplicatedGradAllReduce", "TPPlanPolicy", "model_tp_plan"]

logger = logging.getLogger(__name__)

SUPPORTED_STYLES = frozenset(
    {
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "rowwise_split_input",
        "embedding_rowwise",
        "replicated_with_grad_allreduce",
    }
)
"""Plan styles :class:`TPPlanPolicy` implements."""

_HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


class ReplicatedGradAllReduce:
    """Keeps a module replicated and all-reduces its parameters' gradients over the group.

    For parameters applied to split activations (a per-head ``q_norm`` after a
    column-parallel projection): each rank sees only its heads, so the full gradient is the
    sum over the group.
    """

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None, **kwargs: Any
    ) -> nn.Module:
        """Register the gradient all-reduce on ``module``'s parameters; return ``module``."""
        from colossal.core.comm import all_reduce

        if kwargs:
            raise TypeError(f"ReplicatedGradAllReduce takes no options, got {sorted(kwargs)}")

        def hook(grad: torch.Tensor) -> torch.Tensor:
            # Reduce the incoming gradient (not param.grad): accumulation stays correct.
            grad = grad.clone()
            all_reduce(grad, group=process_group)
            return grad

        for p in module.parameters(recurse=True):
            if p.requires_grad:
                p.register_hook(hook)
        module.process_group = process_group  # type: ignore[assignment]  # stub: Tensor | Module
        return module


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan with paths relative to ``model`` (``{}`` if none).

    Uses the instance's merged ``_tp_plan`` (transformers fills it in ``post_init``), else the
    config's ``base_model_tp_plan`` under the base model prefix plus the class's ``_tp_plan``.
    """
    plan = getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    merged: dict[str, str] = {}
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for key, style in base_plan.items():
        merged[f"{prefix}.{key}" if has_prefix else key] = style
    merged.update(getattr(type(model), "_tp_plan", None) or {})
    return merged


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"(\d+)") + "$")


def _split(path: str, key: str) -> tuple[str, str]:
    """``(container path, suffix)``: split after the module matched by the last ``*``."""
    if "*" not in key:
        return "", path
    n_parts = len(key[: key.rindex("*")].split("."))
    parts = path.split(".")
    return ".".join(parts[:n_parts]), ".".join(parts[n_parts:])


def _parent(suffix: str) -> str:
    return suffix.rpartition(".")[0]


class TPPlanPolicy(Policy):
    """Tensor parallelism from the model's own ``base_model_tp_plan`` (see the module doc).

    Raises (from :meth:`config_sanity_check` / :meth:`module_policy`):
        NotImplementedError: The model has no plan, or the plan uses a style not supported.
        ValueError: Head counts not divisible by the tensor-parallel size.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lm_head_sharded = False

    def _text_config(self) -> Any:
        assert self.model is not None
        config = getattr(self.model, "config", None)
        getter = getattr(config, "get_text_config", None)
        return getter() if callable(getter) else config

    def config_sanity_check(self) -> None:
        """Check there is a plan and the head counts split evenly over the group."""
        assert self.model is not None
        plan = model_tp_plan(self.model)
        if not plan:
            raise NotImplementedError(
                f"{type(self.model).__name__} has no base_model_tp_plan; pass a policy: "
                "ShardFormer(config).optimize(model, policy=MyPolicy())"
            )
        tp = self.tp_size
        if tp == 1 or "colwise" not in plan.values():
            return
        config = self._text_config()
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value % tp != 0:
                raise ValueError(
                    f"{type(self.model).__name__}: {name}={value} is not divisible by the "
                    f"tensor-parallel size {tp}; use a tensor-parallel size that divides it"
                )

    def _replacement(self, path: str, style: str, module: nn.Module) -> Any:
        from colossal.shardformer import layer

        assert self.shard_config is not None and self.model is not None
        vocab = {"make_vocab_size_divisible_by": self.shard_config.make_vocab_size_divisible_by}
        output_embeddings = getattr(self.model, "get_output_embeddings", lambda: None)()
        linear = isinstance(module, nn.Linear)
        if style == "embedding_rowwise" and isinstance(module, nn.Embedding):
            return layer.VocabParallelEmbedding1D, vocab
        if style == "colwise_gather_output" and module is output_embeddings and linear:
            self.lm_head_sharded = True
            gather = not self.shard_config.parallel_output
            return layer.VocabParallelLMHead1D, {"gather_output": gather, **vocab}
        if style in ("colwise", "colwise_gather_output") and linear:
            return layer.Linear1D_Col, {"gather_output": style == "colwise_gather_output"}
        if style in ("rowwise", "rowwise_split_input") and linear:
            return layer.Linear1D_Row, {"parallel_input": style == "rowwise"}
        if style == "replicated_with_grad_allreduce":
            return ReplicatedGradAllReduce, {}
        raise NotImplementedError(
            f"{type(self.model).__name__}: tensor-parallel style {style!r} of {path!r} "
            f"({type(module).__name__}) is not supported by the derived policy (supported: "
            f"{sorted(SUPPORTED_STYLES)} on nn.Linear/nn.Embedding); write a policy for this "
            "model and pass it: ShardFormer(config).optimize(model, policy=MyPolicy())"
        )

    def module_policy(self) -> PolicyMap:
        """Container class -> replacements, divided head counts and shared TP regions."""
        assert self.model is not None
        model = self.model
        self.lm_head_sharded = False  # per model chunk: a pipeline stage may lack the head
        plan = model_tp_plan(model)
        modules = dict(model.named_modules())
        entries: dict[str, tuple[str, str]] = {}  # module path -> (plan key, style)
        from colossal.shardformer.pipeline.placeholders import is_placeholder

        for key, style in plan.items():
            pattern = _pattern(key)
            for path in modules:
                # a pipeline stage's stand-in for another stage's module stays as it is
                if pattern.match(path) and not is_placeholder(modules[path]):
                    entries[path] = (key, style)
        embeddings = getattr(model, "get_input_embeddings", lambda: None)()
        if isinstance(embeddings, nn.Embedding):
            emb_path = next(p for p, m in modules.items() if m is embeddings)
            if type(embeddings) is nn.Embedding:
                entries.setdefault(emb_path, (emb_path, "embedding_rowwise"))
            else:
                self._keep_replicated(emb_path, embeddings, entries, modules)

        policy: PolicyMap = {}
        colwise: dict[type[nn.Module], dict[str, set[str]]] = {}
        for path, (key, style) in entries.items():
            container_path, suffix = _split(path, key)
            container = modules[container_path]
            target, kwargs = self._replacement(path, style, modules[path])
            desc = policy.setdefault(type(container), ModulePolicyDescription())
            if any(d.suffix == suffix for d in desc.sub_module_replacement):
                continue
            desc.sub_module_replacement.append(
                SubModuleReplacementDescription(suffix, target, kwargs, ignore_if_not_exist=True)
            )
            if style == "colwise":
                siblings = colwise.setdefault(type(container), {})
                siblings.setdefault(_parent(suffix), set()).add(suffix)
                self._divide_heads(container, _parent(suffix), desc)

        for cls, parents in colwise.items():
            planned = {d.suffix for d in policy[cls].sub_module_replacement}
            example = next(m for m in modules.values() if type(m) is cls)
            for parent, children in parents.items():
                if len(children) > 1 and self._all_children_planned(example, parent, planned):
                    policy[cls].tp_region_inputs.append(parent)
        return policy

    def _keep_replicated(
        self,
        emb_path: str,
        embeddings: nn.Embedding,
        entries: dict[str, tuple[str, str]],
        modules: dict[str, nn.Module],
    ) -> None:
        """Leave an embedding subclass (Gemma's scaled one) and a head tied to it whole.

        Its forward does more than a lookup, which the vocab-parallel layer would drop.
        """
        entries.pop(emb_path, None)
        for path in [p for p in entries if modules[p] is not embeddings]:
            if getattr(modules[path], "weight", None) is embeddings.weight:
                entries.pop(path)
        logger.info(
            "%s: %s at %r is not a plain nn.Embedding; it (and a head tied to it) stays replicated",
            type(self.model).__name__,
            type(embeddings).__name__,
            emb_path,
        )

    def _divide_heads(
        self, container: nn.Module, parent: str, desc: ModulePolicyDescription
    ) -> None:
        from colossal.shardformer.shard.sharder import get_submodule

        owner = get_submodule(container, parent)
        for name in _HEAD_ATTRIBUTES:
            value = getattr(owner, name, None)
            attr = f"{parent}.{name}" if parent else name
            if isinstance(value, int) and not isinstance(value, bool):
                if attr not in desc.attribute_replacement:
                    if value % self.tp_size:
                        raise ValueError(
                            f"{type(owner).__name__}.{name}={value} is not divisible by the "
                            f"tensor-parallel size {self.tp_size}"
                        )
                    desc.attribute_replacement[attr] = value // self.tp_size

    @staticmethod
    def _all_children_planned(container: nn.Module, parent: str, planned: set[str]) -> bool:
        from colossal.shardformer.shard.sharder import get_submodule

        owner = get_submodule(container, parent)
        if owner is None:
            return False
        for name, child in owner.named_children():
            suffix = f"{parent}.{name}" if parent else name
            has_params = any(True for _ in child.parameters())
            if has_params and suffix not in planned:
                return False
        return True

    def grid_plan(self) -> GridPlan:
        """The 2D / 2.5D / 3D plan derived from the tensor-parallel plan.

        The blocks are the container of the plan's ``*`` keys (``model.layers``); ``colwise``
        layers read the block's hidden state (role ``"in"``), ``rowwise`` ones write back to it
        (``"out"``), ``replicated_with_grad_allreduce`` modules stay whole with their gradients
        summed over the grid. The block's LayerNorms and Llama-style RMSNorms become grid norms;
        keys without ``*`` (embedding, LM head) stay replicated.

        Raises:
            NotImplementedError: A style the grid modes do not support inside the blocks, or
                keys spread over several containers.
        """
        from colossal.shardformer.grid import GridPlan
        from colossal.shardformer.grid.layers import is_rms_norm
        from colossal.shardformer.shard.sharder import get_submodule

        assert self.model is not None
        name = type(self.model).__name__
        layers: str | None = None
        linears: dict[str, str] = {}
        replicated: list[str] = []
        for key, style in model_tp_plan(self.model).items():
            if ".*." not in key:
                continue  # outside the blocks: replicated in the grid modes
            container, _, suffix = key.partition(".*.")
            if layers not in (None, container):
                raise NotImplementedError(
                    f"{name}: the tensor-parallel plan has blocks under {layers!r} and "
                    f"{container!r}; the grid modes shard one list of blocks (write a policy)"
                )
            layers = container
            if style in ("colwise", "rowwise"):
                linears[suffix] = "in" if style == "colwise" else "out"
            elif style == "replicated_with_grad_allreduce":
                replicated.append(suffix)
            else:
                raise NotImplementedError(
                    f"{name}: tensor-parallel style {style!r} of {key!r} is not supported by "
                    "the grid modes (supported inside the blocks: colwise, rowwise, "
                    "replicated_with_grad_allreduce); use tensor_parallel_mode='1d'"
                )
        if layers is None:
            raise NotImplementedError(f"{name}: the tensor-parallel plan names no blocks")
        blocks = get_submodule(self.model, layers)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise NotImplementedError(f"{name}: {layers!r} is not a list of blocks")
        example = blocks[0]
        norms = tuple(
            n for n, m in example.named_modules()
            if n and not any(n == r or n.startswith(f"{r}.") for r in replicated)
            and (isinstance(m, nn.LayerNorm) or is_rms_norm(m))
        )  # fmt: skip
        heads: dict[str, int] = {}
        for suffix, role in linears.items():
            parent = _parent(suffix)
            owner = get_submodule(example, parent)
            for attr in _HEAD_ATTRIBUTES:
                value = getattr(owner, attr, None)
                if role == "in" and isinstance(value, int) and not isinstance(value, bool):
                    heads[f"{parent}.{attr}" if parent else attr] = value
        config = self._text_config()
        sizes = {n: getattr(config, n, None) for n in ("hidden_size", "intermediate_size")}
        heads_names = ("num_attention_heads", "num_key_value_heads")
        counts = {n: getattr(config, n, None) for n in heads_names}
        return GridPlan(
            layers=layers,
            linears=linears,
            norms=norms,
            replicated_grad=tuple(replicated),
            heads=heads,
            widths={k: v for k, v in sizes.items() if isinstance(v, int)},
            head_counts={k: v for k, v in counts.items() if isinstance(v, int)},
        )

    def postprocess(self) -> nn.Module:
        """Install the vocab-parallel loss when the LM head keeps its logits split."""
        from colossal.shardformer.shard.model_hooks import install_vocab_parallel_loss

        assert self.model is not None and self.shard_config is not None
        if self.lm_head_sharded and self.shard_config.parallel_output:
            install_vocab_parallel_loss(self.model, self.shard_config.tensor_parallel_process_group)
        return self.model
