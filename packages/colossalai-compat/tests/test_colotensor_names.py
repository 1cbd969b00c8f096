"""The seeds' ColoTensor imports (colotensor_concept.md, the Megatron-via-ColoTensor tutorial).

Catches: a ``colossalai.tensor`` or ``colossalai.utils.model.colo_init_context`` name that is
missing, or served as a copy instead of Colossal's own object (``isinstance`` against the
seeds' class would then fail on our tensors), and the old "not implemented" answer for
``ColoInitContext`` coming back.
"""

from __future__ import annotations

import colossal.legacy.tensor as ours

SEED_IMPORTS = (
    "from colossalai.tensor import ProcessGroup, ColoTensor, ColoTensorSpec, ShardSpec, "
    "ComputeSpec, ComputePattern",
    "from colossalai.tensor import ShardSpec, ComputeSpec, ComputePattern, ColoParameter, "
    "ProcessGroup",
    "from colossalai.tensor.distspec import ShardSpec, ReplicaSpec",
    "from colossalai.utils.model.colo_init_context import ColoInitContext",
    "from colossalai.legacy.tensor import ColoTensor",
)


def test_seed_colotensor_imports_are_ours() -> None:
    """Every name the seeds import is the object of ``colossal.legacy.tensor``."""
    for line in SEED_IMPORTS:
        scope: dict[str, object] = {}
        exec(line, scope)
        names = [n for n in scope if n != "__builtins__"]
        assert names, line
        for name in names:
            assert scope[name] is getattr(ours, name), (line, name)
