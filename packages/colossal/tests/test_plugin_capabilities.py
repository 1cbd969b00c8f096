"""What plugins say they support, and arguments that do nothing saying so.

Catches: a plugin class whose capability attributes and methods disagree, a new plugin
inheriting a capability it lacks, and HybridParallelPlugin accepting torch-DDP settings or
``enable_jit_fused`` silently (they have no effect there).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from colossal.booster.plugin import Plugin
from colossal.booster.plugin.hybrid.config import unused_arguments
from colossal.core.testing import distributed_test


def test_plugin_defaults_support_nothing_optional() -> None:
    class Minimal(Plugin):
        configure = get_checkpoint_io = lambda self, *a: None  # noqa: E731

    plugin = Minimal()
    assert plugin.supported_precisions() == ["fp32"] and not plugin.control_precision()
    assert not plugin.support_no_sync() and not plugin.support_lora()
    assert not plugin.support_pipeline() and plugin.lora_reader(None) is None  # type: ignore


@pytest.mark.parametrize(("name", "lora", "precisions"), [
    ("TorchDDPPlugin", True, ("fp32", "fp16", "bf16")),
    ("TorchFSDPPlugin", True, ("fp32", "bf16")),
    ("LowLevelZeroPlugin", True, ("fp16", "bf16", "fp32")),
    ("GeminiPlugin", False, ("fp16", "bf16", "fp32")),  # decided per instance (tp_size)
    ("HybridParallelPlugin", False, ("fp16", "bf16", "fp32")),  # per instance
])
def test_capabilities_are_class_attributes(name: str, lora: bool, precisions: tuple) -> None:
    import colossal.booster.plugin as plugins

    cls = getattr(plugins, name)
    assert cls.SUPPORTED_PRECISIONS == precisions and cls.SUPPORTS_LORA is lora
    assert cls.CONTROLS_PRECISION is (name != "TorchDDPPlugin")


def test_unused_arguments_are_named() -> None:
    defaults: dict[str, Any] = {"broadcast_buffers": True, "ddp_bucket_cap_mb": 25,
                                "find_unused_parameters": False, "check_reduction": False,
                                "gradient_as_bucket_view": False, "static_graph": False}
    assert unused_arguments(defaults, False) == []
    changed = unused_arguments({**defaults, "static_graph": True, "ddp_bucket_cap_mb": 50}, True)
    assert changed == ["ddp_bucket_cap_mb=50", "static_graph=True", "enable_jit_fused=True"]


@distributed_test(1)
def test_hybrid_warns_once_about_arguments_without_effect(rank: int, world_size: int) -> None:
    from colossal.booster.plugin import HybridParallelPlugin

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("colossal.booster.plugin.hybrid.plugin").addHandler(handler)
    for _ in range(2):
        HybridParallelPlugin(tp_size=1, pp_size=1, static_graph=True, enable_jit_fused=True)
    HybridParallelPlugin(tp_size=1, pp_size=1)  # defaults: nothing to say
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "static_graph=True" in warned[0] and "enable_jit_fused=True" in warned[0]
