"""The one markdown table of ``tools/gpu_check.sh``, read from its output folder.

Usage::

    python tools/gpu_report.py OUT_DIR

``OUT_DIR`` holds ``steps.tsv`` (one ``name<TAB>exit status<TAB>seconds`` line per step),
the steps' logs (``NAME.log``), JUnit XML of the pytest steps (``NAME.xml``), the benchmarks'
JSON records (``NAME.json``: ``{"benchmark", "rows", "goals"}`` as ``benchmarks/bench_common``
writes them) and ``gpu.txt`` (nvidia-smi's line). One table row per step: its status and time
and what it found (test counts; each goal's value, target and whether it was met; for
``gpu_check`` each ours-against-peer ratio and its correctness check). A step that failed
shows the last line of its log. Exit status 1 when any step failed or timed out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize_junit import count_file  # noqa: E402

TIMED_OUT = 124


@dataclass(frozen=True)
class Step:
    """One line of ``steps.tsv``."""

    name: str
    status: int
    seconds: int

    @property
    def verdict(self) -> str:
        """The step's outcome: ok, failed (status) or timed out."""
        if self.status == 0:
            return "ok"
        return "timed out" if self.status == TIMED_OUT else f"failed ({self.status})"


def read_steps(out: Path) -> list[Step]:
    """The steps recorded in ``out/steps.tsv``, in order."""
    steps = []
    for line in (out / "steps.tsv").read_text(encoding="utf-8").splitlines():
        if line.strip():
            name, status, seconds = line.split("\t")
            steps.append(Step(name, int(status), int(seconds)))
    return steps


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ").strip()


def _last_line(path: Path) -> str:
    if not path.exists():
        return "no log"
    lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()
             if ln.strip()]
    return lines[-1] if lines else "empty log"


def findings(out: Path, step: Step) -> list[str]:
    """What a step found, one entry per fact (test counts, goals, ratios)."""
    found: list[str] = []
    xml = out / f"{step.name}.xml"
    if xml.exists():
        found.append(str(count_file(xml)))
    record = _bench_record(out, step.name)
    if record is not None:
        for goal in record.get("goals", []):
            mark = "met" if goal.get("met") else "NOT met"
            found.append(f"{goal['name']} {goal['value']:.3g} (goal {goal['target']}: {mark})")
        if record.get("benchmark") == "gpu_check":
            found += [f"{r['section']} {r['ours']} / {r['peer']} = {r['ratio']:.3f} "
                      f"({r['check']}: {r['diff']:.1e})" for r in record.get("rows", [])]
    if step.status != 0:
        found.append(f"log: {_last_line(out / f'{step.name}.log')}")
    return found


def _bench_record(out: Path, step_name: str) -> dict | None:
    stem = step_name.removesuffix("_bench")
    path = out / f"{stem}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def render(out: Path) -> str:
    """The markdown table (and the GPU's line above it)."""
    gpu = out / "gpu.txt"
    lines = [f"GPU: {gpu.read_text(encoding='utf-8').strip() if gpu.exists() else 'unknown'}",
             "", "| step | result | seconds | found |", "|---|---|---|---|"]
    for step in read_steps(out):
        found = "; ".join(_cell(f) for f in findings(out, step)) or "-"
        lines.append(f"| {step.name} | {step.verdict} | {step.seconds} | {found} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; exit status 1 when a step failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="tools/gpu_check.sh's output folder")
    args = parser.parse_args(argv)
    if not (args.out / "steps.tsv").exists():
        print(f"gpu_report: {args.out}/steps.tsv is missing: run tools/gpu_check.sh first",
              file=sys.stderr)
        return 1
    print(render(args.out))
    return 0 if all(s.status == 0 for s in read_steps(args.out)) else 1


if __name__ == "__main__":
    sys.exit(main())
