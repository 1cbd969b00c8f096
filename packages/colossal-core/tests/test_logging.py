"""Rank-aware logging helpers."""

from __future__ import annotations

import logging

import pytest

from colossal.core.logging import (
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
