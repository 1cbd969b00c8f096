"""A save replaces only its own kind of files: user files and the other kinds survive."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from booster_testlib import make_booster, make_model, make_optimizer, train_steps

from colossal.checkpoint_io import MODEL_INDEX, OPTIMIZER_INDEX
from colossal.core.testing import spawn


def _user_files(directory: str) -> None:
    os.makedirs(os.path.join(directory, "run1", "deep"), exist_ok=True)
    with open(os.path.join(directory, "notes.txt"), "w") as file:
        file.write("my notes")
    with open(os.path.join(directory, "run1", "deep", "log.txt"), "w") as file:
        file.write("run 1 log")


def _assert_user_files(directory: str) -> None:
    with open(os.path.join(directory, "notes.txt")) as file:
        assert file.read() == "my notes"
    with open(os.path.join(directory, "run1", "deep", "log.txt")) as file:
        assert file.read() == "run 1 log"


def _model_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.unwrap().state_dict().items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


# ---- the three data-loss cases of issue 12 (each failed before the fix) ----------------------


def _save_into_user_dir(rank: int, world: int, path: str) -> None:
    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    booster.save_model(model, path, shard=True, size_per_shard=0.0005)
    _assert_user_files(path)  # caught: the directory swap deleted notes.txt and run1/
    fresh, *_ = make_booster("ddp").boost(make_model(seed=9))
    booster.load_model(fresh, path)
    _assert_equal(_model_state(fresh), _model_state(model))


def test_save_model_keeps_user_files(tmp_path) -> None:
    path = str(tmp_path / "outputs")
    _user_files(path)
    spawn(_save_into_user_dir, 1, args=(path,))
    _assert_user_files(path)


def _model_then_optimizer(rank: int, world: int, path: str) -> None:
    booster = make_booster("ddp")
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    train_steps(model, optimizer, booster, range(2), rank, world)
    booster.save_model(model, path)
    booster.save_optimizer(optimizer, path)
    assert os.path.isfile(os.path.join(path, MODEL_INDEX))  # caught: the optimizer deleted it
    assert os.path.isfile(os.path.join(path, OPTIMIZER_INDEX))
    fresh = make_model(seed=9)
    fresh, fresh_opt, *_ = make_booster("ddp").boost(fresh, make_optimizer(fresh))
    booster.load_model(fresh, path)  # caught: "interrupted" although nothing was
    booster.load_optimizer(fresh_opt, path)
    _assert_equal(_model_state(fresh), _model_state(model))
    for p, q in zip(fresh_opt.unwrap().param_groups[0]["params"],
                    optimizer.unwrap().param_groups[0]["params"], strict=True):
        got, want = fresh_opt.unwrap().state[p], optimizer.unwrap().state[q]
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=0, atol=0)


def test_save_optimizer_keeps_model_in_same_directory(tmp_path) -> None:
    spawn(_model_then_optimizer, 1, args=(str(tmp_path / "ck"),))


def _save_read_only(rank: int, world: int, path: str) -> str:
    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    with pytest.raises(PermissionError) as info:
        booster.save_model(model, path)
    return str(info.value)


@pytest.mark.parametrize("world", [1, 2])
def test_save_into_read_only_directory_fails_and_leaves_it(tmp_path, world) -> None:
    path = str(tmp_path / "ro")
    _user_files(path)
    os.chmod(path, 0o555)
    before = os.stat(path)
    try:
        messages = spawn(_save_read_only, world, args=(path,))  # every rank raises, none hangs
        after = os.stat(path)
        # caught: the directory was replaced by a new, writable one (another inode)
        assert (after.st_ino, stat.S_IMODE(after.st_mode)) == (before.st_ino, 0o555)
        for message in messages:
            assert path in message and "read-only" in message
        assert sorted(os.listdir(path)) == ["notes.txt", "run1"]
        assert not [n for n in os.listdir(tmp_path) if n != "ro"]
    finally:
        os.chmod(path, 0o755)


# ---- model + optimizer + scheduler + user files in one directory, saved twice -----------------


def _all_in_one(rank: int, world: int, path: str, use_async: bool) -> None:
    def boost(seed: int):
        booster = make_booster("ddp")
        model = make_model(seed)
        optimizer = make_optimizer(model)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
        return booster, model, optimizer, scheduler

    booster, model, optimizer, scheduler = boost(1234)
    saved = {}
    for step in range(2):  # the second save replaces the first one's files of each kind
        train_steps(model, optimizer, booster, range(step * 2, step * 2 + 2), rank, world)
        scheduler.step()
        # shard sizes differ between the saves so the second leaves stale shards to remove
        size = 0.0005 if step == 0 else 0.002
        booster.save_model(model, path, shard=True, size_per_shard=size, use_async=use_async)
        booster.save_optimizer(optimizer, path, shard=True, size_per_shard=size,
                               use_async=use_async)
        booster.save_lr_scheduler(scheduler, path)
        saved = {
            "model": _model_state(model),
            "exp_avg": [optimizer.unwrap().state[p]["exp_avg"].clone()
                        for g in optimizer.unwrap().param_groups for p in g["params"]],
            "lr": scheduler.get_last_lr(),
        }
        booster.wait_async_saves()
    _assert_user_files(path)
    fresh_booster, fresh, fresh_opt, fresh_sched = boost(99)
    fresh_booster.load_model(fresh, path)
    fresh_booster.load_optimizer(fresh_opt, path)
    fresh_booster.load_lr_scheduler(fresh_sched, path)
    _assert_equal(_model_state(fresh), saved["model"])
    got = [fresh_opt.unwrap().state[p]["exp_avg"]
           for g in fresh_opt.unwrap().param_groups for p in g["params"]]
    for a, b in zip(got, saved["exp_avg"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fresh_sched.get_last_lr() == saved["lr"] and fresh_sched.last_epoch == 2
    if rank == 0:  # only the second save's shards are left, nothing of the staging
        files = set(os.listdir(path))
        for index in (MODEL_INDEX, OPTIMIZER_INDEX):
            import json

            with open(os.path.join(path, index)) as file:
                referenced = set(json.load(file)["weight_map"].values())
            kind = index.split(".")[0]
            assert {n for n in files if n.startswith(kind) and n != index} == referenced
        assert not [n for n in files if n.startswith(".")], files


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_model_optimizer_scheduler_and_user_files_share_a_directory(tmp_path, world, mode):
    path = str(tmp_path / "checkpoint-2")
    _user_files(path)
    spawn(_all_in_one, world, args=(path, mode == "async"))
    _assert_user_files(path)
