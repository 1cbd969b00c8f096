"""Rank-aware logging helpers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import colossal.core
from colossal.core.logging import (
    DistributedLogger,
    disable_existing_loggers,
    get_dist_logger,
    get_logger,
    log_on_master,
    log_on_ranks,
    warn_once,
)
from colossal.core.testing import distributed_test


def test_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    logger = get_logger("colossal.test.warn_once")
    with caplog.at_level(logging.WARNING):
        assert warn_once(logger, "slow path for %s", "x")
        assert not warn_once(logger, "slow path for %s", "x")
        assert warn_once(logger, "slow path for %s", "y")
    assert [r.getMessage() for r in caplog.records] == ["slow path for x", "slow path for y"]


def test_single_process_counts_as_rank_zero(caplog: pytest.LogCaptureFixture) -> None:
    logger = get_logger("colossal.test.single")
    with caplog.at_level(logging.INFO):
        log_on_master(logger, "master says %d", 1)
        log_on_ranks(logger, "rank one says", ranks=[1])
        get_dist_logger("colossal.test.single").info("adapter", ranks=[0])
    assert [r.getMessage() for r in caplog.records] == ["master says 1", "[rank 0] adapter"]


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@distributed_test(2)
def test_logs_only_on_chosen_ranks(rank: int, world_size: int) -> None:
    logger = get_logger("colossal.test.ranks")
    logger.setLevel(logging.INFO)
    handler = _ListHandler()
    logger.addHandler(handler)
    log_on_master(logger, "only master")
    log_on_ranks(logger, "only one", ranks=[1])
    log_on_ranks(logger, "everyone", ranks=None)
    get_dist_logger("colossal.test.ranks").warning("adapter %s", "w", ranks=[1])
    expected = {0: ["only master", "everyone"], 1: ["only one", "everyone", "[rank 1] adapter w"]}
    assert handler.messages == expected[rank]


# ---- ColossalAI's names: get_dist_logger(), ranks=..., disable_existing_loggers ----------------


@pytest.fixture
def restore_logger_levels():
    """Put back every logger's level and handlers after a test that changes them."""
    loggers = [logging.getLogger()] + [
        obj for obj in logging.Logger.manager.loggerDict.values() if isinstance(obj, logging.Logger)
    ]
    saved = {id(lg): (lg, lg.level, list(lg.handlers)) for lg in loggers}
    yield
    for lg in [
        obj for obj in logging.Logger.manager.loggerDict.values() if isinstance(obj, logging.Logger)
    ]:
        if id(lg) not in saved:
            lg.setLevel(logging.NOTSET)
    for lg, level, handlers in saved.values():
        lg.setLevel(level)
        for handler in lg.handlers[:]:
            if handler not in handlers:
                lg.removeHandler(handler)
                handler.close()


@pytest.mark.usefixtures("restore_logger_levels")  # get_dist_logger() sets "colossal" to INFO
def test_get_dist_logger_without_name_is_the_colossal_logger() -> None:
    """Catches: the ColossalAI call ``get_dist_logger()`` failing (name was required)."""
    logger = get_dist_logger()
    assert isinstance(logger, DistributedLogger)
    assert logger.logger is logging.getLogger("colossal")
    assert colossal.core.get_dist_logger is get_dist_logger
    assert colossal.core.disable_existing_loggers is disable_existing_loggers


@pytest.mark.parametrize("method", ["debug", "info", "warning", "error"])
def test_every_level_filters_by_rank_without_a_process_group(
    method: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches: a level that ignores ``ranks`` or that needs torch.distributed initialized."""
    assert not torch.distributed.is_initialized()
    logger = get_dist_logger("colossal.test.levels")
    with caplog.at_level(logging.DEBUG, logger="colossal.test.levels"):
        getattr(logger, method)("on zero %d", 0, ranks=[0])
        getattr(logger, method)("on one", ranks=[1])
        getattr(logger, method)("on all", ranks=None)
        getattr(logger, method)("default all")
    assert [r.getMessage() for r in caplog.records] == [
        "[rank 0] on zero 0", "[rank 0] on all", "[rank 0] default all",
    ]  # fmt: skip
    assert {r.levelname for r in caplog.records} == {method.upper()}


def test_records_name_the_callers_line(caplog: pytest.LogCaptureFixture) -> None:
    """Catches: every record pointing at the adapter instead of the user's code."""
    with caplog.at_level(logging.INFO, logger="colossal.test.caller"):
        get_dist_logger("colossal.test.caller").info("here", ranks=[0])
        get_dist_logger("colossal.test.caller").log(logging.INFO, "there")
    assert [r.funcName for r in caplog.records] == ["test_records_name_the_callers_line"] * 2
    assert all(r.pathname == __file__ for r in caplog.records)


_PRINTS_BY_DEFAULT = """
import logging
import sys
from colossal.core import get_dist_logger
get_dist_logger().info("shown %d", 1, ranks=[0])
get_dist_logger().debug("hidden")
logging.getLogger("colossal.zero.part").info("library line")
logging.getLogger("elsewhere").info("not ours")
logging.basicConfig(level=logging.INFO, format="configured: %(message)s", stream=sys.stdout)
get_dist_logger().info("after basicConfig")
"""


def test_get_dist_logger_prints_info_by_default_and_once_when_configured() -> None:
    """ColossalAI's ``get_dist_logger().info(...)`` prints without any logging setup.

    Catches: INFO lines swallowed (the root's WARNING level), DEBUG shown, loggers outside
    ``colossal`` made chatty, and lines printed twice once the script configures logging.
    """
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PRINTS_BY_DEFAULT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "colossal - INFO: [rank 0] shown 1",
        "colossal.zero.part - INFO: library line",
        "configured: [rank 0] after basicConfig",
    ], done.stdout
    assert "not ours" not in done.stderr


@pytest.mark.usefixtures("restore_logger_levels")
def test_get_dist_logger_adds_one_fallback_and_keeps_a_set_level() -> None:
    """Catches: a handler added per call (lines multiplied), a level set by the user reset
    to INFO by the next ``get_dist_logger()``, or plain ``get_logger`` configuring output."""
    name = "colossal.test.fallback"
    get_dist_logger(name)
    get_dist_logger(name).set_level("WARNING")
    get_dist_logger(name)
    logger = logging.getLogger(name)
    assert len(logger.handlers) == 1 and logger.level == logging.WARNING
    get_logger("colossal.test.plain_library")
    assert logging.getLogger("colossal.test.plain_library").handlers == []


@pytest.mark.usefixtures("restore_logger_levels")
def test_disable_existing_loggers_spares_colossal() -> None:
    """Catches: our own loggers (or their children) silenced, or other loggers left chatty."""
    names = ["thirdparty", "thirdparty.sub", "colossal", "colossal.zero.x", "colossalish"]
    for name in names:
        logging.getLogger(name).setLevel(logging.DEBUG)
    changed = disable_existing_loggers()
    levels = {n: logging.getLogger(n).level for n in names}
    assert levels == {
        "thirdparty": logging.WARNING, "thirdparty.sub": logging.WARNING,
        "colossal": logging.DEBUG, "colossal.zero.x": logging.DEBUG,
        "colossalish": logging.WARNING,  # a name prefix is not a child
    }  # fmt: skip
    assert {"thirdparty", "thirdparty.sub", "colossalish"} <= set(changed)
    assert not {"colossal", "colossal.zero.x"} & set(changed)
    assert logging.getLogger().level != logging.WARNING or "root" not in changed


@pytest.mark.usefixtures("restore_logger_levels")
def test_disable_existing_loggers_include_and_exclude() -> None:
    for name in ["a.b", "a.b.c", "d", "colossal.core.q"]:
        logging.getLogger(name).setLevel(logging.INFO)
    assert disable_existing_loggers(include=["a.b"], level="ERROR") == ["a.b", "a.b.c"]
    assert logging.getLogger("d").level == logging.INFO
    disable_existing_loggers(exclude=["d"])
    assert logging.getLogger("d").level == logging.INFO
    assert logging.getLogger("colossal.core.q").level == logging.WARNING
    with pytest.raises(TypeError, match=r"include=\['a'\]"):
        disable_existing_loggers(include="a")
    with pytest.raises(ValueError, match="LOUD"):
        disable_existing_loggers(level="LOUD")


@pytest.mark.usefixtures("restore_logger_levels")
def test_log_to_file_and_set_level(tmp_path: Path) -> None:
    logger = get_dist_logger("colossal.test.file")
    logger.set_level("WARNING")
    path = logger.log_to_file(tmp_path, mode="w", level="INFO", suffix="run")
    assert path == str(tmp_path / "rank_0_run.log")
    logger.info("written", ranks=[0])
    logger.info("not this rank", ranks=[1])
    logger.debug("too low")
    for handler in logger.logger.handlers:
        handler.flush()
    text = Path(path).read_text()
    assert "[rank 0] written" in text
    assert "not this rank" not in text and "too low" not in text
    with pytest.raises(ValueError, match="mode"):
        logger.log_to_file(tmp_path, mode="r")


@distributed_test(2)
def test_colossalai_style_logging_on_two_ranks(rank: int, world_size: int, tmp_path: Path) -> None:
    """Catches: ``ranks=[0]`` logging on every rank, or ranks taken from a local index."""
    logger = get_dist_logger()
    handler = _ListHandler()
    logger.logger.addHandler(handler)
    logger.set_level("DEBUG")
    logger.info("init done", ranks=[0])
    logger.warning("second only", ranks=[1])
    logger.error("everyone")
    logger.debug("both listed", ranks=[0, 1])
    path = logger.log_to_file(tmp_path)
    logger.info("to file", ranks=[1])
    for h in logger.logger.handlers:
        h.flush()
    expected = {
        0: ["[rank 0] init done", "[rank 0] everyone", "[rank 0] both listed"],
        1: ["[rank 1] second only", "[rank 1] everyone", "[rank 1] both listed",
            "[rank 1] to file"],
    }  # fmt: skip
    assert handler.messages == expected[rank]
    assert path == str(tmp_path / f"rank_{rank}.log")
    assert ("to file" in Path(path).read_text()) == (rank == 1)
