"""Multi-host live jobs on loopback: each "host" is a process group of its own (the first serves the store)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from parashift.cli import main
from parashift.errors import StrategyError
from parashift.exec.hosts import SECRET_ENV, parse_endpoint, read_secret

SECRET = "hosts-test-secret-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parashift", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every host; on timeout kill their process groups (the test then fails)."""
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def test_two_hosts_train_as_the_static_job(capsys):
    port = _free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    common = ["--endpoint", f"127.0.0.1:{port}", "--nprocs", "2", "--timeout", "150"]
    first = _host(["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2", "--steps", "3", "--live", *common,
                   "--json"], env)
    time.sleep(0.5)
    agent = _host(["join", *common], env)
    (rc1, out1, err1), (rc2, out2, err2) = _finish([first, agent], 170)
    assert rc1 == 0, err1[-2000:]
    assert rc2 == 0, err2[-2000:]
    got = json.loads(out1)
    assert got["switches"] == [] and got["hosts"] == {"1": [0, 1], "2": [2, 3]}
    assert "devices 2-3 of 4" in err2
    assert SECRET not in out1 + err1 + out2 + err2
    # the same job on one host
    assert main(["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2", "--steps", "3", "--live", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    time.sleep(1.0)
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"


def test_secret_never_from_argv(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(StrategyError, match=SECRET_ENV):
        read_secret(None)
    f = tmp_path / "job.secret"
    made = read_secret(str(f), create=True)
    assert (os.stat(f).st_mode & 0o777) == 0o600 and read_secret(str(f)) == made
    os.chmod(f, 0o644)
    with pytest.raises(StrategyError, match="chmod 600"):
        read_secret(str(f))
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(StrategyError, match="16-128"):
        read_secret(None)
    with pytest.raises(StrategyError, match="HOST:PORT"):
        parse_endpoint("10.0.0.5")
    assert parse_endpoint("[::1]:29500") == ("::1", 29500)


def test_cli_errors(capsys):
    assert main(["run", "--endpoint", "127.0.0.1:29500", "--strategy", "dp=2"]) != 0
    assert "add --live" in capsys.readouterr().err
    assert main(["join", "--nprocs", "1"]) != 0
    assert "--endpoint" in capsys.readouterr().err
