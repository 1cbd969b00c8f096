"""examples/train_gpt.py end to end: plugins agree, a resume under another plugin matches, and
the hybrid plugin (TP2 x PP2) trains like one process."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys

import pytest

from colossal.core.testing import free_port, run_isolated

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--iters", "40", "--eval-interval", "20", "--eval-iters", "4", "--no-progress"]


def _torchrun(*args: str, timeout: float = 300, nproc: int = 2) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", os.path.join(ROOT, "examples", "train_gpt.py"), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_isolated(cmd, timeout=timeout, env=env, cwd=ROOT)  # kills every rank on timeout
    assert done.returncode == 0, f"train_gpt.py failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _final(out: str) -> float:
    found = re.findall(r"final val loss (\d+\.\d+)", out)
    assert found, out
    return float(found[-1])


def test_train_gpt_resume_across_plugins(tmp_path) -> None:
    metrics = tmp_path / "metrics.json"
    straight = _final(_torchrun("--plugin", "ddp", "--out", str(tmp_path / "a"),
                                "--metrics-json", str(metrics), *SHORT))
    written = json.loads(metrics.read_text())  # what benchmarks/main_job.py reads
    assert len(written["iter_ms"]) == 40 and min(written["iter_ms"]) > 0
    assert written["final_val"] == pytest.approx(straight, abs=1e-4) and written["world"] == 2
    first = _torchrun(
        "--plugin", "zero2", "--out", str(tmp_path / "b"), "--save-interval", "20",
        "--stop-after", "20", "--async-save", *SHORT,
    )  # fmt: skip
    assert "stopping after iteration 20" in first
    ckpt = tmp_path / "b" / "checkpoint"
    assert (ckpt / "latest").read_text() == "iter-0000020"
    assert (ckpt / "iter-0000020" / "train_state.json").is_file()
    resumed_out = _torchrun("--plugin", "fsdp", "--out", str(tmp_path / "b"), "--resume", *SHORT)
    resumed = _final(resumed_out)
    assert resumed == pytest.approx(straight, abs=2e-3)
    assert straight < 3.5  # it learned (starts at ~4.2 = ln(vocab))
    png = tmp_path / "b" / "loss.png"
    if importlib.util.find_spec("matplotlib") is not None:  # the examples extra draws it
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--resume",
           "--out", str(tmp_path), *SHORT]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = run_isolated(cmd, timeout=120, env=env, cwd=ROOT)
    assert done.returncode != 0
    assert "no complete checkpoint" in done.stderr


# A small model and batch: 4 ranks on a 2-core machine stay well under a minute.
TINY = ["--iters", "16", "--eval-interval", "8", "--eval-iters", "2", "--n-layer", "2",
        "--n-embd", "64", "--block", "32", "--batch-size", "8", "--lr", "3e-3", "--warmup", "4",
        "--save-interval", "16", "--no-progress"]  # fmt: skip


def _tensors(directory) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_train_gpt_hybrid_tp2_pp2_trains_like_one_process(tmp_path) -> None:
    """TP2 x PP2 on 4 ranks learns, logs and saves what one process does on the same batch.

    dp = 1, so the hybrid job sees the data of a 1-rank run. The pipeline's losses live on
    its last stage (the logged mean is over those ranks: over all 4 it would be halved);
    validation runs forward-only through the stages. Both jobs save at the end: the same
    model and optimizer tensors, whatever the layout.
    """
    import torch

    metrics = tmp_path / "hybrid.json"
    out = _torchrun("--plugin", "hybrid", "--tp", "2", "--pp", "2", "--num-microbatches", "2",
                    "--out", str(tmp_path / "h"), "--metrics-json", str(metrics), *TINY,
                    nproc=4)  # fmt: skip
    assert "plugin hybrid tp2 pp2, 4 ranks" in out, out
    got = json.loads(metrics.read_text())
    assert got["layout"] == {"dp": 1, "pp": 2, "sp": 1, "tp": 2, "sp_mode": None,
                             "zero_stage": 0, "num_microbatches": 2}  # fmt: skip
    assert len(got["train"]) == len(got["iter_ms"]) == 16
    assert got["val"][-1] < got["val"][0] - 0.3, got["val"]  # it learned
    assert got["train"][-1] < got["train"][0] - 0.3, got["train"]
    ref_metrics = tmp_path / "one.json"
    _torchrun("--plugin", "ddp", "--out", str(tmp_path / "r"), "--metrics-json",
              str(ref_metrics), *TINY, nproc=1)  # fmt: skip
    ref = json.loads(ref_metrics.read_text())
    assert got["val"] == pytest.approx(ref["val"], abs=2e-3)
    assert got["train"] == pytest.approx(ref["train"], abs=2e-3)
    for kind in ("model", "optimizer"):
        mine = _tensors(tmp_path / "h" / "checkpoint" / "iter-0000016" / kind)
        theirs = _tensors(tmp_path / "r" / "checkpoint" / "iter-0000016" / kind)
        assert sorted(mine) == sorted(theirs) and mine, kind
        for name, value in theirs.items():
            assert torch.allclose(mine[name].float(), value.float(), atol=1e-4), (kind, name)


def test_train_gpt_hybrid_option_errors() -> None:
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    done = run_isolated([sys.executable, script, "--plugin", "hybrid", "--tp", "2", "--pp", "2",
                         "--save-interval", "10", "--async-save"], timeout=120, cwd=ROOT)
    assert done.returncode == 2  # refused by the argument parser, before any process group
    assert "--async-save with --plugin hybrid --tp 2 --pp 2" in done.stderr, done.stderr
    done = run_isolated([sys.executable, script, "--tp", "2"], timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--tp need --plugin hybrid" in done.stderr, done.stderr
