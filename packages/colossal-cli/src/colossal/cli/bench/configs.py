"""The benchmark's configurations: every valid setup of the installed plugins for N devices.

Most rows train the self-contained GPT of :mod:`colossal.cli.bench.gpt`. Plugins that shard a
Hugging Face model (``HybridParallelPlugin``: Shardformer's tensor/sequence/pipeline
parallelism) train the same shape as ``transformers.GPT2LMHeadModel`` (workload
``"hf-gpt2"``, see :mod:`colossal.cli.bench.workload`). A layout the model cannot take
(tensor-parallel size not dividing the heads, more pipeline stages than layers) is left out
when the model is known, with the reason (:func:`unsupported_reason`).
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from colossal.cli.bench.gpt import GPTConfig

__all__ = [
    "PLUGIN_FAMILIES",
    "PRECISIONS",
    "BenchConfig",
    "enumerate_configs",
    "filter_configs",
    "installed_plugins",
    "split_supported",
    "unsupported_reason",
]

PRECISIONS = ("fp32", "bf16", "fp16")
WORKLOADS = ("gpt", "hf-gpt2")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark row: a plugin with its arguments and a precision.

    Attributes:
        name: Unique label, e.g. ``"zero2-bf16"``; what ``--filter`` matches.
        plugin: Class name in ``colossal.booster.plugin`` (e.g. ``"LowLevelZeroPlugin"``).
        plugin_kwargs: Keyword arguments of the plugin.
        mixed_precision: ``Booster(mixed_precision=...)`` for plugins that do not control
            precision; None otherwise.
        precision: The precision the row trains in (for display).
        workload: ``"gpt"`` (the self-contained GPT) or ``"hf-gpt2"`` (the same shape as a
            transformers ``GPT2LMHeadModel``, for plugins that shard Hugging Face models).
    """

    name: str
    plugin: str
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    mixed_precision: str | None = None
    precision: str = "fp32"
    workload: str = "gpt"

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(
                f"BenchConfig {self.name!r}: workload={self.workload!r} must be one of {WORKLOADS}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what the worker receives)."""
        return {
            "name": self.name,
            "plugin": self.plugin,
            "plugin_kwargs": dict(self.plugin_kwargs),
            "mixed_precision": self.mixed_precision,
            "precision": self.precision,
            "workload": self.workload,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


def _suffix(name: str, precision: str) -> str:
    return name if precision == "fp32" else f"{name}-{precision}"


def _ddp(n: int, precision: str) -> list[BenchConfig]:
    mp = None if precision == "fp32" else precision
    return [BenchConfig(_suffix("ddp", precision), "TorchDDPPlugin", {}, mp, precision)]


def _fsdp(n: int, precision: str) -> list[BenchConfig]:
    return [BenchConfig(_suffix("fsdp", precision), "TorchFSDPPlugin",
                        {"precision": precision}, None, precision)]  # fmt: skip


def _zero(n: int, precision: str) -> list[BenchConfig]:
    return [
        BenchConfig(
            _suffix(f"zero{stage}", precision),
            "LowLevelZeroPlugin",
            {"stage": stage, "precision": precision},
            None,
            precision,
        )  # fmt: skip
        for stage in (1, 2)
    ]


def _gemini(n: int, precision: str) -> list[BenchConfig]:
    return [
        BenchConfig(
            _suffix(f"gemini-{placement}", precision),
            "GeminiPlugin",
            {"placement_policy": placement, "precision": precision},
            None,
            precision,
        )  # fmt: skip
        for placement in ("static", "auto")
    ]


def _hybrid(n: int, precision: str) -> list[BenchConfig]:
    out = []
    for tp in range(1, n + 1):
        for pp in range(1, n // tp + 1):
            if n % (tp * pp) or tp * pp == 1:
                continue  # tp = pp = 1 is plain data parallelism, covered by ddp/zero
            kwargs: dict[str, Any] = {"tp_size": tp, "pp_size": pp, "precision": precision}
            if pp > 1:
                kwargs["microbatch_size"] = 1
            name = _suffix(f"hybrid-tp{tp}-pp{pp}-dp{n // (tp * pp)}", precision)
            out.append(BenchConfig(name, "HybridParallelPlugin", kwargs, None, precision,
                                   workload="hf-gpt2"))  # fmt: skip
    return out


#: Plugin class name -> the configurations it offers for (devices, precision). Families whose
#: plugin is not installed are skipped, so new plugins show up as soon as they exist.
PLUGIN_FAMILIES: dict[str, Callable[[int, str], list[BenchConfig]]] = {
    "TorchDDPPlugin": _ddp,
    "TorchFSDPPlugin": _fsdp,
    "LowLevelZeroPlugin": _zero,
    "GeminiPlugin": _gemini,
    "HybridParallelPlugin": _hybrid,
}


def installed_plugins() -> list[str]:
    """Plugin class names of :data:`PLUGIN_FAMILIES` that ``colossal.booster.plugin`` offers.

    Raises:
        ModuleNotFoundError: The meta-package ``colossal`` is not installed.
    """
    module = importlib.import_module("colossal.booster.plugin")
    out = []
    for name in PLUGIN_FAMILIES:
        try:
            getattr(module, name)
        except (AttributeError, ImportError):
            continue
        out.append(name)
    return out


def unsupported_reason(cfg: BenchConfig, model: GPTConfig) -> str | None:
    """Why ``model`` cannot train under ``cfg`` (None: it can).

    Tensor parallelism splits the attention heads, a pipeline the layers.
    """
    tp = int(cfg.plugin_kwargs.get("tp_size", 1))
    pp = int(cfg.plugin_kwargs.get("pp_size", 1))
    if model.n_head % tp:
        return f"{model.n_head} attention heads do not split over tp_size={tp}"
    if pp > model.n_layer:
        return f"{model.n_layer} layers do not fill pp_size={pp} pipeline stages"
    return None


def split_supported(
    configs: list[BenchConfig], model: GPTConfig
) -> tuple[list[BenchConfig], list[tuple[BenchConfig, str]]]:
    """``configs`` the model can train, and the others with the reason."""
    kept, dropped = [], []
    for cfg in configs:
        reason = unsupported_reason(cfg, model)
        if reason is None:
            kept.append(cfg)
        else:
            dropped.append((cfg, reason))
    return kept, dropped


def enumerate_configs(
    devices: int, plugins: Iterable[str], precisions: Iterable[str] = ("fp32",)
) -> list[BenchConfig]:
    """Every configuration of ``plugins`` on ``devices`` ranks, in each precision.

    Whether a model fits a layout is :func:`split_supported`'s question.

    Raises:
        ValueError: ``devices < 1``, an unknown plugin or an unknown precision.
    """
    if devices < 1:
        raise ValueError(f"the benchmark needs at least 1 device, got {devices}")
    precisions = list(precisions)
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise ValueError(f"unknown precision {', '.join(bad)}; choose from {', '.join(PRECISIONS)}")
    out: list[BenchConfig] = []
    for plugin in plugins:
        if plugin not in PLUGIN_FAMILIES:
            raise ValueError(f"unknown plugin {plugin!r}; known: {', '.join(PLUGIN_FAMILIES)}")
        for precision in precisions:
            out.extend(PLUGIN_FAMILIES[plugin](devices, precision))
    return out


def filter_configs(configs: list[BenchConfig], pattern: str | None) -> list[BenchConfig]:
    """Keep the configurations whose name matches ``pattern``.

    ``pattern`` is comma-separated; each part is a glob (``zero*``) or, without wildcards, a
    substring (``fsdp``).

    Raises:
        ValueError: Nothing matches (the message lists the available names).
    """
    if not pattern:
        return configs
    parts = [p.strip() for p in pattern.split(",") if p.strip()]

    def hit(name: str) -> bool:
        return any(
            fnmatch.fnmatchcase(name, p) if any(c in p for c in "*?[") else p in name for p in parts
        )

    kept = [c for c in configs if hit(c.name)]
    if not kept:
        raise ValueError(
            f"--filter {pattern!r} matches no configuration; available: "
            f"{', '.join(c.name for c in configs)}"
        )
    return kept
