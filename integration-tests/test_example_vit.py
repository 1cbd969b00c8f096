"""examples/vit/train_vit.py end to end: one process (DDP) and TP2 x PP2 on four processes learn
the digits, agree with each other, and write their metrics and curves.

Both runs are short: ``EPOCHS`` epochs with the example's defaults otherwise (its warm-up and
cosine decay compressed into them). The held-out set has 360 images, so a model guessing at
chance (10 classes) scores 0.10 with a standard deviation of sqrt(0.1 * 0.9 / 360) = 0.016;
``MIN_ACCURACY`` is 30 standard deviations above that, and below what such a run reached with
every seed tried (0.83 to 0.93 for seeds 42, 1 and 2; 0.93 with the default seed used here),
so it tests learning, not luck, and leaves room for floating-point differences elsewhere.
The two layouts see the same batches from the same initial weights, so they differ only by
floating-point summation order: their held-out losses agree to ``LOSS_ATOL`` (over the full
30 epochs they stayed within 4e-4 of each other) and their accuracies within a few images.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from colossal.core.testing import free_port, run_isolated

pytest.importorskip("transformers")
pytest.importorskip("sklearn")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 8
MIN_ACCURACY = 0.6
LOSS_ATOL = 5e-3
SAME_IMAGES = 3 / 360  # accuracies of the two layouts within 3 held-out images


def _train(out: str, nproc: int, *args: str, timeout: float = 240) -> dict:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", os.path.join(ROOT, "examples", "vit", "train_vit.py"),
        "--epochs", str(EPOCHS), "--no-progress", "--out", out, *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_isolated(cmd, timeout=timeout, env=env, cwd=ROOT)  # kills every rank on timeout
    assert done.returncode == 0, f"train_vit.py failed:\n{done.stdout}\n{done.stderr}"
    assert "final held-out accuracy" in done.stdout, done.stdout
    with open(os.path.join(out, "metrics.json"), encoding="utf-8") as fh:
        metrics = json.load(fh)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        with open(os.path.join(out, "curves.png"), "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    return metrics


def test_vit_example_learns_under_ddp_and_tp2_pp2(tmp_path) -> None:
    ddp = _train(str(tmp_path / "ddp"), 1, "--plugin", "ddp")
    hybrid = _train(
        str(tmp_path / "hybrid"), 4,
        "--plugin", "hybrid_parallel", "--tp", "2", "--pp", "2", "--num-microbatches", "2",
    )  # fmt: skip
    assert (hybrid["world"], hybrid["tp"], hybrid["pp"], hybrid["dp"]) == (4, 2, 2, 1)
    for metrics in (ddp, hybrid):
        assert metrics["epoch"] == list(range(1, EPOCHS + 1))
        assert metrics["final_accuracy"] == metrics["val_accuracy"][-1]
        assert metrics["final_accuracy"] >= MIN_ACCURACY, metrics
        assert metrics["train_loss"][-1] < metrics["train_loss"][0], metrics
    assert hybrid["train_loss"] == pytest.approx(ddp["train_loss"], abs=LOSS_ATOL)
    assert hybrid["val_loss"] == pytest.approx(ddp["val_loss"], abs=LOSS_ATOL)
    assert abs(hybrid["final_accuracy"] - ddp["final_accuracy"]) <= SAME_IMAGES + 1e-9
