"""The hostfile check: reading hostfiles, and passwordless ssh to each host (a stand-in ssh)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from nblaunch.cluster import hosts

# A stand-in ssh: answers by host name the way the real one does, and logs its arguments.
FAKE_SSH = """#!/bin/sh
echo "$@" >> "$SSH_LOG"
for last; do :; done          # the command ("hostname")
host=""
for arg; do
  case "$arg" in -o) skip=1; continue;; esac
  if [ -n "$skip" ]; then skip=""; continue; fi
  if [ -z "$host" ]; then host="$arg"; fi
done
case "$host" in
  alpha) echo alpha ;;
  beta) echo beta-7.cluster.local ;;
  locked) echo "alice@locked: Permission denied (publickey,password)." >&2; exit 255 ;;
  newkey) echo "Host key verification failed." >&2; exit 255 ;;
  nowhere) echo "ssh: Could not resolve hostname nowhere: Name or service not known" >&2
           exit 255 ;;
  slow) exec sleep 30 ;;
  *) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
esac
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """A directory first on PATH holding a stand-in ``ssh``; returns (bin dir, ssh log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "ssh", FAKE_SSH)
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(log))
    return bin_dir, log


def test_read_hostfile_formats(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nalpha slots=4\nbeta:8  # MPICH style\n\nalpha\n  gamma\n")
    assert hosts.read_hostfile(hostfile) == ["alpha", "beta", "gamma"]


def test_check_hosts_with_a_stand_in_ssh(tmp_path, fake_bin):
    bin_dir, log = fake_bin
    _executable(bin_dir / "mpirun", "#!/bin/sh\necho 'mpirun (Open MPI) 4.1.2'\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alpha slots=2\nbeta slots=2\nlocked\nnewkey\nnowhere\nslow\nrefuser\n")
    started = time.monotonic()
    result = hosts.check_hosts(hostfile, timeout=1.0)
    elapsed = time.monotonic() - started
    by_host = {check.host: check for check in result.hosts}
    assert by_host["alpha"].ok and by_host["alpha"].answered == "alpha"
    assert by_host["beta"].ok and by_host["beta"].answered == "beta-7.cluster.local"
    assert "ssh-copy-id locked" in by_host["locked"].fix
    assert "known_hosts" in by_host["newkey"].fix
    assert "does not resolve" in by_host["nowhere"].problem
    assert "no answer within 3 s" in by_host["slow"].problem
    assert "nothing listens" in by_host["refuser"].problem
    assert not result.ok
    assert elapsed < 15  # hosts are checked side by side, each with its own timeout
    calls = log.read_text().splitlines()
    assert len(calls) == 7
    assert all("-o BatchMode=yes -o ConnectTimeout=1" in call for call in calls)
    text = result.text()
    assert "ok    alpha: passwordless SSH works\n" in text
    assert "beta: passwordless SSH works (it calls itself 'beta-7.cluster.local')" in text
    assert "FAIL  locked:" in text and "fix: set up key login" in text
    assert "mpirun (Open MPI) 4.1.2" in text
    assert "2 of 7 host(s) reachable" in text


def test_check_hosts_reports_a_missing_hostfile_and_missing_mpirun(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ssh nor mpirun
    result = hosts.check_hosts(tmp_path / "nope")
    assert not result.ok and "cannot read the hostfile" in result.text()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("alpha\n")
    text = hosts.check_hosts(hostfile).text()
    assert "ssh is not on PATH" in text
    assert "mpirun: not found on PATH" in text
