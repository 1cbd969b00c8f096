from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before
# Triton is imported. On a CUDA machine the real compiler is used.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_registry_choices():
    from colossal.kernels import REGISTRY

    yield
    REGISTRY.reset()


def triton_ok() -> bool:
    from colossal.kernels._triton import interpreter_enabled, triton_installed

    return triton_installed() and (torch.cuda.is_available() or interpreter_enabled())


needs_triton = pytest.mark.skipif(not triton_ok(), reason="triton not installed")
