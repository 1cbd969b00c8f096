"""The seed-snippet counts at the end of the run (what the compat package serves of them)."""

from __future__ import annotations

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    ran = terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("xfailed", [])
    if not any("test_seed_snippets" in report.nodeid for report in ran):
        return
    from seed_snippets import summary

    terminalreporter.section("seed snippets through colossalai-compat")
    for key, value in summary().items():
        if isinstance(value, list):
            value = f"{len(value)}: {', '.join(value)}" if value else "0"
        terminalreporter.write_line(f"{key}: {value}")
