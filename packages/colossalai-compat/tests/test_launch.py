"""colossalai.launch*: both of ColossalAI's call forms reach colossal-legacy's launchers."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import colossalai
import pytest
from rank_procs import run_ranks

LEGACY_LAUNCH = importlib.import_module("colossal.legacy.launch")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[tuple, dict]]]:
    """Replace colossal-legacy's launchers by recorders: launcher name -> [(args, kwargs)]."""
    seen: dict[str, list[tuple[tuple, dict]]] = {}
    for name in ("launch", "launch_from_torch", "launch_from_slurm", "launch_from_openmpi"):

        def record(*args: object, _name: str = name, **kwargs: object) -> None:
            seen.setdefault(_name, []).append((args, kwargs))

        monkeypatch.setattr(LEGACY_LAUNCH, name, record)
    return seen


CFG = {"parallel": {"pipeline": 2}}


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        # config-era: the config first, positionally or by keyword
        (lambda: colossalai.launch(CFG, 0, 2, "h", 29500), ((CFG, 0, 2, "h", 29500), {})),
        (
            lambda: colossalai.launch(config=CFG, rank=0, world_size=2, host="h", port=1),
            ((CFG,), {"rank": 0, "world_size": 2, "host": "h", "port": 1}),
        ),
        (lambda: colossalai.launch("cfg.py", 1, 2, "h", 1), (("cfg.py", 1, 2, "h", 1), {})),
        # today's form: no config at all -> config=None (gpc is still filled)
        (lambda: colossalai.launch(0, 2, "h", 29500), ((None, 0, 2, "h", 29500), {})),
        (
            lambda: colossalai.launch(rank=1, world_size=2, port=7, host="localhost"),
            ((None,), {"rank": 1, "world_size": 2, "port": 7, "host": "localhost"}),
        ),
    ],
    ids=["config-positional", "config-keyword", "config-path", "today", "today-keywords"],
)
def test_launch_forms(calls: dict, call, expected: tuple) -> None:
    call()
    assert calls == {"launch": [expected]}


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda: colossalai.launch_from_torch(CFG), ((CFG,), {})),
        (lambda: colossalai.launch_from_torch(config="c.py"), (("c.py",), {})),
        (lambda: colossalai.launch_from_torch("c.py", "gloo"), (("c.py", "gloo"), {})),
        (lambda: colossalai.launch_from_torch("gloo"), ((None, "gloo"), {})),
        (lambda: colossalai.launch_from_torch(backend="nccl"), ((None,), {"backend": "nccl"})),
        (lambda: colossalai.launch_from_torch(), ((None,), {})),
    ],
    ids=["config", "config-keyword", "config-backend", "backend", "backend-keyword", "bare"],
)
def test_launch_from_torch_forms(calls: dict, call, expected: tuple) -> None:
    call()
    assert calls == {"launch_from_torch": [expected]}


@pytest.mark.parametrize("name", ["launch_from_slurm", "launch_from_openmpi"])
def test_launch_from_scheduler_forms(calls: dict, name: str) -> None:
    launcher = getattr(colossalai, name)
    launcher(CFG, "node0", 29500)
    launcher("cfg.py", "node0", "29500")
    launcher("node0", 29500, "gloo")
    launcher("node0", "29500")
    launcher(config=CFG, host="node0", port=29500)
    launcher(host="node0", port=29500)
    assert calls[name] == [
        ((CFG, "node0", 29500), {}),
        (("cfg.py", "node0", "29500"), {}),
        ((None, "node0", 29500, "gloo"), {}),
        ((None, "node0", "29500"), {}),
        ((CFG,), {"host": "node0", "port": 29500}),
        ((None,), {"host": "node0", "port": 29500}),
    ]


# ---- in real processes: ColossalAI's scripts launch themselves ------------------------------

# The seeds' ViT data-parallel tutorial, as written: get_default_parser, launch_from_torch with
# the config file, gpc.config; then the test's checks.
CONFIG_SCRIPT = """
import colossalai
from colossalai.context import ParallelMode
from colossalai.core import global_context as gpc
from colossalai.logging import disable_existing_loggers, get_dist_logger

# initialize distributed setting
parser = colossalai.get_default_parser()
args = parser.parse_args()
colossalai.launch_from_torch(config=args.config)

disable_existing_loggers()
logger = get_dist_logger()

# checks of the test
import colossal.legacy.core
assert gpc is colossal.legacy.core.gpc
assert gpc.config.BATCH_SIZE == 8 and gpc.config.fp16.mode == "torch", gpc.config
assert gpc.pipeline_parallel_size == 2 and gpc.data_parallel_size == 1
assert gpc.get_world_size(ParallelMode.PIPELINE) == 2
assert gpc.get_local_rank(ParallelMode.PIPELINE) == gpc.get_global_rank()
assert gpc.is_pipeline_first_stage() == (gpc.get_global_rank() == 0)
print("rank", gpc.get_global_rank(), "BATCH_SIZE", gpc.config.BATCH_SIZE)
"""

CONFIG_FILE = """
BATCH_SIZE = 8
parallel = dict(pipeline=2)
fp16 = dict(mode="torch")
"""


def test_config_launch_fills_gpc(tmp_path: Path) -> None:
    (tmp_path / "config.py").write_text(textwrap.dedent(CONFIG_FILE))
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(CONFIG_SCRIPT))
    results = run_ranks(script, 2, ["--config", "config.py"])
    for result in results:
        assert f"rank {result.rank} BATCH_SIZE 8" in result.output
