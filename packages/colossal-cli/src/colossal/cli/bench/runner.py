"""Running configurations one by one, each in its own torchrun subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from colossal.cli.bench.configs import BenchConfig

__all__ = [
    "METRICS",
    "BenchSettings",
    "failure_row",
    "reason_from_output",
    "run_all",
    "run_one",
    "settings_dict",
    "worker_command",
]

#: Result fields a failed row leaves empty.
METRICS = ("step_time_s", "tokens_per_s", "peak_model_state_bytes", "comm_bytes_per_step")


@dataclass(frozen=True)
class BenchSettings:
    """How every configuration is run.

    Attributes:
        devices: Ranks per configuration (GPUs, or CPU processes when ``cpu``).
        cpu: Run on CPU processes with gloo (``COLOSSAL_ACCELERATOR=cpu``).
        steps: Measured steps.
        warmup: Unmeasured steps first.
        model_size: A name of :data:`colossal.cli.bench.gpt.MODEL_SIZES`.
        seq_len: Tokens per sample.
        batch_size: Samples per rank per step.
        timeout: Seconds one configuration may take before it is stopped.
    """

    devices: int
    cpu: bool
    steps: int = 5
    warmup: int = 1
    model_size: str = "tiny"
    seq_len: int = 64
    batch_size: int = 4
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("devices", "steps", "seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(cfg: BenchConfig, settings: BenchSettings, out: str, port: int) -> list[str]:
    """The torchrun argv that runs ``cfg`` and writes its result to ``out``."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={settings.devices}",
        "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "colossal.cli.bench.worker", "--config", json.dumps(cfg.to_dict()), "--out", out,
        "--steps", str(settings.steps), "--warmup", str(settings.warmup),
        "--model-size", settings.model_size, "--seq-len", str(settings.seq_len),
        "--batch-size", str(settings.batch_size),
    ]  # fmt: skip


def failure_row(cfg: BenchConfig, status: str, error: str) -> dict[str, Any]:
    """A row for a configuration that did not finish (metrics are None)."""
    return {**cfg.to_dict(), "status": status, "error": error, **dict.fromkeys(METRICS)}


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?\s*$",
    re.DOTALL | re.MULTILINE,
)
_PY_ERROR = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))\b:?(.*)$")


def reason_from_output(text: str) -> str:
    """Why a torchrun job failed, read from its output.

    Names the failing rank, its exit code or signal, and the last Python exception or C++
    ``terminate`` message (torchrun's own ``ChildFailedError`` report is skipped).
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = ""
    for line in reversed(lines):
        if line.startswith("terminate called") or (
            _PY_ERROR.match(line) and "ChildFailedError" not in line
        ):
            detail = line[:240]
            break
    cause = _ROOT_CAUSE.search(text)
    if cause is not None:
        rank, code, signal = cause.groups()
        how = f"killed by {signal}" if signal else f"exit code {code}"
        return f"rank {rank} {how}" + (f": {detail}" if detail else "")
    return detail or (lines[-1][:300] if lines else "no output")


def run_one(cfg: BenchConfig, settings: BenchSettings) -> dict[str, Any]:
    """Run one configuration in a subprocess and return its row (never raises for it)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if settings.cpu:
        env["COLOSSAL_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory(prefix="colossal-bench-") as tmp:
        out = str(Path(tmp) / "result.json")
        cmd = worker_command(cfg, settings, out, _free_port())
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=settings.timeout, errors="replace")  # fmt: skip
        except subprocess.TimeoutExpired:
            return failure_row(cfg, "timeout", f"did not finish in {settings.timeout:g}s")
        if done.returncode == 0 and os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                return {**json.load(f), "error": None}
        errs = sorted(Path(tmp).glob("result.json.rank*.err"))
        if errs:
            data = json.loads(errs[0].read_text(encoding="utf-8"))
            return failure_row(cfg, data["status"], f"rank {data['rank']}: {data['error']}")
        status = "oom" if "out of memory" in done.stderr else "failed"
        return failure_row(cfg, status, reason_from_output(done.stderr + done.stdout))


def run_all(
    configs: list[BenchConfig],
    settings: BenchSettings,
    on_done: Callable[[BenchConfig, dict[str, Any]], None] | None = None,
    run: Callable[[BenchConfig, BenchSettings], dict[str, Any]] = run_one,
) -> list[dict[str, Any]]:
    """Run every configuration in order; a failure becomes a row and the rest continue.

    Args:
        configs: What to run.
        settings: How to run it.
        on_done: Called after each configuration (e.g. to advance a progress bar).
        run: Runs one configuration (:func:`run_one`; tests pass a fake).
    """
    rows = []
    for cfg in configs:
        try:
            row = run(cfg, settings)
        except Exception as exc:  # noqa: BLE001 - one broken row must not stop the others
            row = failure_row(cfg, "failed", f"{type(exc).__name__}: {exc}")
        rows.append(row)
        if on_done is not None:
            on_done(cfg, row)
    return rows


def settings_dict(settings: BenchSettings) -> dict[str, Any]:
    """JSON-ready form of the settings."""
    return asdict(settings)
