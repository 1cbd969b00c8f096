from __future__ import annotations

import shlex
import sys

import pytest
from click.testing import CliRunner

from colossal.cli import HostInfo, filter_hosts, parse_host_list, parse_hostfile
from colossal.cli.launch_command import (
    NOT_FORWARDED_ENV_NAMES,
    forwarded_env,
    parse_extra_launch_args,
)
from colossal.cli.main import cli
from colossal.cli.run_command import misplaced_option_error, plan_launch

PY = sys.executable
ENV = {"PATH": "/usr/bin", "NCCL_DEBUG": "INFO", "HOSTNAME": "me", "PYTHONPATH": "/a b"}


def test_single_node_exact_command() -> None:
    plan = plan_launch("train.py", ("--lr", "0.1"), nproc_per_node=4, master_port=29505)
    assert plan.nodes == []
    assert plan.local == [
        PY, "-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes=1", "--node_rank=0",
        "--master_addr=127.0.0.1", "--master_port=29505", "train.py", "--lr", "0.1",
    ]  # fmt: skip


def test_single_node_module_and_extra_args() -> None:
    plan = plan_launch("pkg.train", ("-x",), module=True, extra_launch_args="max_restarts=1,a")
    assert plan.local is not None
    assert plan.local[3:] == [
        "--nproc_per_node=1", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
        "--master_port=29500", "--max_restarts=1", "--a", "-m", "pkg.train", "-x",
    ]  # fmt: skip


def test_multi_node_exact_commands() -> None:
    plan = plan_launch(
        "train.py", ("--epochs", "2"), host="host1,host2", nproc_per_node=4,
        master_addr="host1", master_port=1234, ssh_port=2222, workdir="/w d", environ=ENV,
    )  # fmt: skip
    assert plan.local is None
    assert [h for h, _ in plan.nodes] == ["host1", "host2"]
    for rank, (host, argv) in enumerate(plan.nodes):
        assert argv[:-1] == [
            "ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
            "-p", "2222", host,
        ]  # fmt: skip
        assert argv[-1] == (
            "cd '/w d' && export NCCL_DEBUG=INFO PATH=/usr/bin PYTHONPATH='/a b' && exec "
            f"{PY} -m colossal.cli.watchdog --grace 10 -- "
            f"{PY} -m torch.distributed.run --nproc_per_node=4 --nnodes=2 --node_rank={rank} "
            "--master_addr=host1 --master_port=1234 train.py --epochs 2"
        )


def test_env_forwarding_exact_set() -> None:
    env = {
        # forwarded: everything a job may need, including the user's own variables
        "PATH": "/usr/bin", "PYTHONPATH": "/a b", "NCCL_DEBUG": "INFO", "DATA": "/data",
        "WANDB_API_KEY": "k", "CUDA_VISIBLE_DEVICES": "0,1", "MULTI": "a\nb", "EMPTY": "",
        "lower_case": "1",
        # dropped: this host, shell, login, terminal, scheduler or torchrun
        "HOSTNAME": "n1", "PWD": "/w", "OLDPWD": "/", "SHLVL": "2", "_": "/usr/bin/colossal",
        "HOME": "/root", "USER": "u", "SHELL": "/bin/bash", "TERM": "xterm", "DISPLAY": ":0",
        "TERM_PROGRAM": "vscode", "SSH_AUTH_SOCK": "/tmp/a", "SSH_CONNECTION": "1 2 3 4",
        "SSH_TTY": "/dev/pts/0", "XDG_RUNTIME_DIR": "/run/user/0", "XDG_SESSION_ID": "3",
        "TMUX": "/tmp/t", "LS_COLORS": "di=1", "COLUMNS": "80", "SLURM_PROCID": "0",
        "OMPI_COMM_WORLD_RANK": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
        "MASTER_ADDR": "n1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x",
        # dropped: names `export` rejects
        "BASH_FUNC_f%%": "() { :; }", "a.b": "1", "1X": "1",
    }  # fmt: skip
    assert forwarded_env(env) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "DATA": "/data", "EMPTY": "", "MULTI": "a\nb",
        "NCCL_DEBUG": "INFO", "PATH": "/usr/bin", "PYTHONPATH": "/a b", "WANDB_API_KEY": "k",
        "lower_case": "1",
    }  # fmt: skip
    assert list(forwarded_env(env)) == sorted(forwarded_env(env))  # stable command lines
    assert {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME"} <= NOT_FORWARDED_ENV_NAMES


def test_env_forwarding_in_the_remote_command() -> None:
    env = {"DATA": "/my data", "MULTI": "a\nb", "HOSTNAME": "n1", "SSH_TTY": "/dev/pts/1"}
    plan = plan_launch("t.py", host="h1,h2", master_addr="h1", workdir="/w", environ=env)
    for _, argv in plan.nodes:
        assert argv[-1].startswith("cd /w && export DATA='/my data' MULTI='a\nb' && exec ")
        words = shlex.split(argv[-1])
        assert words[4:6] == ["DATA=/my data", "MULTI=a\nb"]  # the shell sees the exact values


def test_multi_node_needs_master_addr() -> None:
    with pytest.raises(ValueError, match="needs --master_addr.*--master_addr host1"):
        plan_launch("t.py", host="host1,host2")
    with pytest.raises(ValueError, match="'localhost' cannot be used on several machines"):
        plan_launch("t.py", host="host1,host2", master_addr="localhost")


def test_all_loopback_hosts_may_use_loopback_master() -> None:
    plan = plan_launch("t.py", host="localhost,127.0.0.1", master_addr="127.0.0.1", environ={})
    assert len(plan.nodes) == 2
    assert "--nnodes=2 --node_rank=1 --master_addr=127.0.0.1" in plan.nodes[1][1][-1]


def test_single_loopback_host_runs_locally() -> None:
    plan = plan_launch("t.py", host="localhost:3")
    assert plan.local is not None and "--nproc_per_node=3" in plan.local


def _hostfile(tmp_path, text: str) -> str:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def test_hostfile_parsing(tmp_path) -> None:
    path = _hostfile(tmp_path, "# nodes\nnode1 slots=8\n\n  node2:8  # second\nnode3\n")
    assert parse_hostfile(path) == [HostInfo("node1", 8), HostInfo("node2", 8), HostInfo("node3")]


def test_hostfile_errors_name_line_numbers(tmp_path) -> None:
    path = _hostfile(tmp_path, "node1\nnode2 gpus=4\n# ok\nnode1\nnode3 slots=2 extra\nbad/host\n")
    with pytest.raises(ValueError) as info:
        parse_hostfile(path)
    msg = str(info.value)
    assert "line 2: expected 'slots=N' after the host name, got 'gpus=4'" in msg
    assert "line 4: host 'node1' already listed on line 1" in msg
    assert "line 5: expected 'host', 'host slots=N' or 'host:N'" in msg
    assert "line 6: invalid host name 'bad/host'" in msg
    assert "line 1:" not in msg and "line 3:" not in msg


def test_hostfile_empty_and_missing(tmp_path) -> None:
    with pytest.raises(ValueError, match="lists no host"):
        parse_hostfile(_hostfile(tmp_path, "# nothing\n\n"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")


def test_include_exclude(tmp_path) -> None:
    hosts = [HostInfo(f"h{i}") for i in range(1, 5)]
    assert [h.hostname for h in filter_hosts(hosts, include="h3,h1")] == ["h1", "h3"]
    assert [h.hostname for h in filter_hosts(hosts, exclude="h2")] == ["h1", "h3", "h4"]
    with pytest.raises(ValueError, match="cannot be used together"):
        filter_hosts(hosts, include="h1", exclude="h2")
    with pytest.raises(ValueError, match="--exclude names h9, which the host list"):
        filter_hosts(hosts, exclude="h9")
    with pytest.raises(ValueError, match="removed every host"):
        filter_hosts(hosts, exclude="h1,h2,h3,h4")


def test_hostfile_include_num_nodes_commands(tmp_path) -> None:
    path = _hostfile(tmp_path, "h1 slots=2\nh2 slots=2\nh3 slots=2\n")
    plan = plan_launch("t.py", hostfile=path, exclude="h1", master_addr="h2", environ={})
    assert [h for h, _ in plan.nodes] == ["h2", "h3"]
    assert "--nproc_per_node=2 --nnodes=2 --node_rank=1" in plan.nodes[1][1][-1]
    plan = plan_launch("t.py", hostfile=path, num_nodes=1, master_addr="h1", environ={})
    assert [h for h, _ in plan.nodes] == ["h1"]
    with pytest.raises(ValueError, match="--num_nodes 4 is more than the 3 available"):
        plan_launch("t.py", hostfile=path, num_nodes=4, master_addr="h1")


def test_include_through_the_built_commands(tmp_path) -> None:
    path = _hostfile(tmp_path, "h1 slots=4\nh2 slots=4\nh3 slots=4\nh4 slots=4\n")
    plan = plan_launch("t.py", ("--x",), hostfile=path, include="h4,h2", master_addr="h2",
                       master_port=2000, workdir="/w", environ={})  # fmt: skip
    assert plan.local is None
    assert [h for h, _ in plan.nodes] == ["h2", "h4"]  # hostfile order, not --include order
    for rank, (host, argv) in enumerate(plan.nodes):
        assert argv[-2] == host
        assert argv[-1] == (
            f"cd /w && exec {PY} -m colossal.cli.watchdog --grace 10 -- "
            f"{PY} -m torch.distributed.run --nproc_per_node=4 --nnodes=2 "
            f"--node_rank={rank} --master_addr=h2 --master_port=2000 t.py --x"
        )
    plan = plan_launch("t.py", host="h1,h2,h3", include="h3", master_addr="h3", environ={})
    assert [h for h, _ in plan.nodes] == ["h3"]
    assert "--nproc_per_node=1 --nnodes=1 --node_rank=0 --master_addr=h3 " in plan.nodes[0][1][-1]
    plan = plan_launch("t.py", host="localhost:2,h2", include="localhost")
    assert plan.nodes == [] and plan.local is not None  # only this machine left: no ssh
    assert "--nproc_per_node=2" in plan.local
    with pytest.raises(ValueError, match="--include names h9"):
        plan_launch("t.py", hostfile=path, include="h1,h9", master_addr="h1")


def test_misplaced_option_is_a_usage_error() -> None:
    known = ["--nproc_per_node", "--nproc-per-node", "--master_addr", "--host"]
    msg = misplaced_option_error("--nprocs_per_node", known)
    assert msg is not None
    assert msg.startswith("no such option: --nprocs_per_node (did you mean --nproc_per_node?)")
    assert "see `colossal run --help`" in str(misplaced_option_error("--zzz=3", known))
    assert "no such option: --zzz " in str(misplaced_option_error("--zzz=3", known))
    assert misplaced_option_error("train.py", known) is None
    assert misplaced_option_error("-", known) is None
    runner = CliRunner()
    res = runner.invoke(cli, ["run", "--dry_run", "--nprocs_per_node", "2", "train.py"])
    assert res.exit_code == 2, res.output
    assert "no such option: --nprocs_per_node (did you mean --nproc_per_node?)" in res.output
    res = runner.invoke(cli, ["run", "--dry_run", "--master-adr=h1", "train.py"])
    assert res.exit_code == 2 and "--master-adr (did you mean --master-addr?)" in res.output
    # Options after the script still belong to the script.
    res = runner.invoke(cli, ["run", "--dry_run", "train.py", "--nprocs_per_node", "2"])
    assert res.exit_code == 0, res.output
    assert shlex.split(res.output)[-3:] == ["train.py", "--nprocs_per_node", "2"]


def test_differing_slots_need_nproc(tmp_path) -> None:
    path = _hostfile(tmp_path, "h1 slots=2\nh2 slots=4\n")
    with pytest.raises(ValueError, match=r"h1=2, h2=4.*pass --nproc_per_node"):
        plan_launch("t.py", hostfile=path, master_addr="h1")
    plan = plan_launch("t.py", hostfile=path, master_addr="h1", nproc_per_node=2, environ={})
    assert all("--nproc_per_node=2 " in argv[-1] for _, argv in plan.nodes)


def test_host_list_errors() -> None:
    assert parse_host_list("a,b:2") == [HostInfo("a"), HostInfo("b", 2)]
    with pytest.raises(ValueError, match="empty entry"):
        parse_host_list("a,,b")
    with pytest.raises(ValueError, match="lists a more than once"):
        parse_host_list("a,b,a")
    with pytest.raises(ValueError, match="empty entry"):
        parse_extra_launch_args("a=1,,b")


def test_cli_dry_run_and_usage_errors() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["run", "--dry_run", "--nproc_per_node", "2", "t.py", "--nproc", "9"])
    assert res.exit_code == 0, res.output
    assert shlex.split(res.output.strip())[3:] == [
        "--nproc_per_node=2", "--nnodes=1", "--node_rank=0", "--master_addr=127.0.0.1",
        "--master_port=29500", "t.py", "--nproc", "9",
    ]  # fmt: skip
    res = runner.invoke(cli, ["run", "--host", "a,b", "t.py"])
    assert res.exit_code == 2 and "needs --master_addr" in res.output
    res = runner.invoke(cli, ["run", "--num_nodes", "2", "t.py"])
    assert res.exit_code == 2 and "--num_nodes 2 needs the nodes' names" in res.output
    res = runner.invoke(cli, ["run", "--host", "a", "--hostfile", "f", "t.py"])
    assert res.exit_code == 2 and "cannot be used together" in res.output
    res = runner.invoke(cli, ["run", "--nproc_per_node", "0", "t.py"])
    assert res.exit_code == 2 and "--nproc_per_node must be >= 1, got 0" in res.output
