"""`colossal run` refuses what cannot start before it starts anything.

A missing script used to start torchrun (or ssh to every node), which then failed once per
process; a hostfile line such as ``host2:4:5`` used to be taken as a host called
``host2:4:5``. Process starts are replaced by recorders, so every test can see that nothing
was started.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from colossal.cli import HostInfo, parse_host_list, parse_hostfile, run_command
from colossal.cli.main import cli
from colossal.cli.run_command import check_user_script


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[object]:
    """Run in an empty directory and record what would have been started."""
    calls: list[object] = []
    monkeypatch.setattr(run_command, "run_local", lambda argv, *_, **__: calls.append(argv) or 0)
    monkeypatch.setattr(run_command, "run_nodes", lambda nodes, *_, **__: calls.append(nodes) or 0)
    monkeypatch.chdir(tmp_path)
    return calls


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["run", *args])
    return result.exit_code, result.output


def test_missing_script_starts_nothing(started: list[object], tmp_path: Path) -> None:
    """Catches: torchrun started for a script that does not exist."""
    code, out = _run("--nproc_per_node", "2", "trian.py", "--lr", "1")
    assert code == 2, out
    assert "script 'trian.py' does not exist" in out
    assert str(tmp_path / "trian.py") in out.replace("\n", "")
    assert started == []


def test_missing_script_on_several_nodes_starts_no_ssh(started: list[object]) -> None:
    """Catches: ssh sessions opened on every node before the script was checked."""
    code, out = _run("--host", "h1,h2", "--master_addr", "h1", "missing.py")
    assert code == 2 and "script 'missing.py' does not exist" in out
    assert started == []


def test_existing_script_is_started(started: list[object], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    code, out = _run("--nproc_per_node", "2", "train.py", "--lr", "1")
    assert code == 0, out
    assert len(started) == 1
    argv = started[0]
    assert isinstance(argv, list) and argv[-3:] == ["train.py", "--lr", "1"]


def test_script_given_by_absolute_path(started: list[object], tmp_path: Path) -> None:
    script = tmp_path / "sub" / "t.py"
    script.parent.mkdir()
    script.write_text("")
    assert _run(str(script))[0] == 0
    assert len(started) == 1


def test_directory_needs_main(started: list[object], tmp_path: Path) -> None:
    """Catches: a directory accepted as a script (python would fail in every process)."""
    (tmp_path / "proj").mkdir()
    code, out = _run("proj")
    assert code == 2 and "is a directory" in out and "__main__.py" in out
    assert started == []
    (tmp_path / "proj" / "__main__.py").write_text("")
    assert _run("proj")[0] == 0  # python runs a directory with __main__.py
    assert len(started) == 1


def test_module_launches_still_work(started: list[object], tmp_path: Path) -> None:
    """Catches: the script check breaking ``colossal run -m``."""
    assert _run("-m", "json.tool")[0] == 0  # an installed module
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("raise SystemExit('must not be imported')")
    (tmp_path / "mypkg" / "train.py").write_text("")
    code, out = _run("-m", "mypkg.train", "--x")  # found in the working directory
    assert code == 0, out
    assert started[-1][-3:] == ["-m", "mypkg.train", "--x"]  # type: ignore[index]
    assert len(started) == 2


def test_missing_module_starts_nothing(started: list[object]) -> None:
    code, out = _run("-m", "no_such_pkg_4711.train")
    assert code == 2 and "no module 'no_such_pkg_4711'" in out
    code, out = _run("-m", "train.py/x")
    assert code == 2 and "is not a module name" in out
    assert started == []


def test_missing_script_that_looks_like_a_module_suggests_m(started: list[object]) -> None:
    code, out = _run("mypkg.train")
    assert code == 2 and "colossal run -m mypkg.train" in out
    assert started == []


def test_dry_run_prints_without_checking(started: list[object]) -> None:
    code, out = _run("--dry_run", "not_yet_written.py")
    assert code == 0 and out.strip().endswith("not_yet_written.py")
    assert started == []


def test_check_user_script_direct(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("")
    check_user_script("a.py", cwd=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'b.py' does not exist"):
        check_user_script("b.py", cwd=str(tmp_path))


# ---- hostfile lines with more than one ':' ---------------------------------------------------


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_hostfile_line_with_two_colons_is_an_error(tmp_path: Path) -> None:
    """Catches: ``host2:4:5`` taken for a host of that name (ssh would fail on it later)."""
    path = _hostfile(tmp_path, "host1:4\n# comment\nhost2:4:5\nhost3:x\nhost4:2 slots=2\n")
    with pytest.raises(ValueError) as info:
        parse_hostfile(path)
    msg = str(info.value)
    assert "line 3: expected 'host', 'host slots=N' or 'host:N', got 'host2:4:5'" in msg
    assert "line 4: expected 'host', 'host slots=N' or 'host:N', got 'host3:x'" in msg
    assert "line 5: invalid host name 'host4:2'" in msg and "(line: 'host4:2 slots=2')" in msg
    assert "line 1:" not in msg and "line 2:" not in msg


def test_hostfile_ipv6_addresses_are_hosts(tmp_path: Path) -> None:
    path = _hostfile(tmp_path, "fe80::1 slots=2\n::1\nnode:3\n")
    assert parse_hostfile(path) == [HostInfo("fe80::1", 2), HostInfo("::1"), HostInfo("node", 3)]


def test_host_option_with_two_colons_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"--host 'a:4:5'.*got 'a:4:5'"):
        parse_host_list("a:4:5")
    with pytest.raises(ValueError, match="invalid host name 'h:1:2'"):
        HostInfo("h:1:2")


def test_cli_reports_the_hostfile_line(started: list[object], tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    path = _hostfile(tmp_path, "host1\nhost2:4:5\n")
    code, out = _run("--hostfile", str(path), "--master_addr", "host1", "train.py")
    assert code == 2 and "line 2:" in out and "'host2:4:5'" in out
    assert started == []
