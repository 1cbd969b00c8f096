"""Summarize the JUnit XML files the nox sessions write into ``.ci-results/``.

Usage::

    python tools/summarize_junit.py [RESULTS_DIR]

Prints one line per result file, then, alone on the last line::

    N passed, N failed, N skipped

Errors (collection errors, fixture errors) count as failed. Exit status: 0 when result files
were found (whatever they report; the test runner's own status says whether tests failed),
1 when there are none, or when a file cannot be read.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".ci-results"


@dataclass
class Counts:
    """Test outcome counts."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0

    def add(self, other: Counts) -> None:
        """Add another file's counts to these."""
        self.passed += other.passed
        self.failed += other.failed
        self.skipped += other.skipped

    def __str__(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"


def count_file(path: Path) -> Counts:
    """Count the outcomes of every ``<testcase>`` in one JUnit XML file.

    Args:
        path: A JUnit XML file (root ``<testsuites>`` or ``<testsuite>``).

    Returns:
        The counts; a test case with a ``<failure>`` or ``<error>`` is failed, one with
        ``<skipped>`` is skipped, any other is passed.

    Raises:
        ET.ParseError: The file is not well-formed XML.
    """
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts.failed += 1
        elif case.find("skipped") is not None:
            counts.skipped += 1
        else:
            counts.passed += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results_dir",
        nargs="?",
        type=Path,
        default=DEFAULT_DIR,
        help=f"directory of JUnit XML files (default: {DEFAULT_DIR})",
    )
    args = parser.parse_args(argv)
    files = sorted(args.results_dir.glob("*.xml")) if args.results_dir.is_dir() else []
    total = Counts()
    status = 0
    if not files:
        print(f"summarize_junit: no JUnit XML files in {args.results_dir}", file=sys.stderr)
        status = 1
    for path in files:
        try:
            counts = count_file(path)
        except (ET.ParseError, OSError) as exc:
            print(f"summarize_junit: cannot read {path}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{path.stem}: {counts}")
        total.add(counts)
    sys.stdout.flush()
    print(total)
    return status


if __name__ == "__main__":
    sys.exit(main())
