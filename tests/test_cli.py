"""The ``nblaunch`` command: ``env``, ``env --hostfile``, ``run SCRIPT -n N``."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nblaunch import cli

NBLAUNCH = Path(sys.executable).with_name("nblaunch")


def run_command(*args, cwd, env=None, timeout=120):
    command = [str(NBLAUNCH)] if NBLAUNCH.exists() else [sys.executable, "-m", "nblaunch"]
    return subprocess.run(
        [*command, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_env_prints_the_report(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "nblaunch environment" in out and "safe start methods" in out


def test_python_dash_m_runs_the_same_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "nblaunch", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0 and done.stdout.startswith("nblaunch ")


def test_env_hostfile_exit_code_says_whether_every_host_answered(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(
        '#!/bin/sh\nfor a; do case "$a" in -*|*=*) ;; *) h="$a"; break;; esac; done\n'
        '[ "$h" = good ] && { echo good; exit 0; }\n'
        'echo "Permission denied (publickey)." >&2; exit 255\n'
    )
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    hosts = tmp_path / "hosts"
    hosts.write_text("good slots=2\n")
    assert cli.main(["env", "--hostfile", str(hosts), "--ssh-timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert "nblaunch environment" in out
    assert "ok    good: passwordless SSH works" in out
    hosts.write_text("good\nbad\n")
    assert cli.main(["env", "--hostfile", str(hosts)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  bad: SSH asks for a password" in out
    assert "fix: set up key login: ssh-keygen, then ssh-copy-id bad" in out


SCRIPT = """
    import sys
    import torch.distributed as dist
    from nblaunch import rank, world_size

    def main():
        t = __import__("torch").tensor([rank() + 1.0])
        dist.all_reduce(t)
        print(f"hello from {rank()} of {world_size()} args={sys.argv[1:]} sum={t.item():g}")
        if "--fail" in sys.argv and rank() == 1:
            raise ValueError("boom on rank 1")
        if "--exit" in sys.argv:
            sys.exit(0)
        if "--exit-3" in sys.argv and rank() == 1:
            sys.exit(3)

    if __name__ == "__main__":
        main()
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_run_script_on_two_ranks(tmp_path, script):
    # Options nblaunch does not know, and everything after "--", go to the script.
    done = run_command("run", "train.py", "-n", "2", "--exit", "--", "--lr", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr  # sys.exit(0) in the script is a success
    for rank in (0, 1):
        assert f"[rank {rank}] hello from {rank} of 2 args=['--exit', '--lr', '3'] sum=3" in (
            done.stdout
        )


@pytest.mark.slow
def test_run_script_failure_shows_the_rank_error(tmp_path, script):
    done = run_command("run", str(script), "-n", "2", "--fail", cwd=tmp_path)
    assert done.returncode == 1
    assert "ValueError: boom on rank 1" in done.stderr
    assert "raised on rank 1 of 2" in done.stderr


def test_run_script_whose_rank_exits_with_a_code_exits_with_it(tmp_path, script):
    done = run_command("run", str(script), "-n", "2", "--exit-3", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "RankFailedError: rank 1 of 2 called sys.exit(3)" in done.stderr


def test_run_missing_script_and_no_command(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "missing.py"), "-n", "2"]) == 2
    assert "no such script" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "env" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["env", "--bogus"])


def test_a_new_subcommand_is_one_function(monkeypatch, capsys):
    def add_hello(subparsers):
        parser = subparsers.add_parser("hello")
        parser.add_argument("name")
        parser.set_defaults(handler=lambda args: print(f"hi {args.name}") or 3)

    monkeypatch.setattr(cli, "COMMANDS", [*cli.COMMANDS, add_hello])
    assert cli.main(["hello", "ada"]) == 3
    assert capsys.readouterr().out == "hi ada\n"
