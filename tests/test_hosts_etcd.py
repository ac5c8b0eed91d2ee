"""A multi-host live job whose store is on etcd (``--store etcd://...``), on loopback hosts."""
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
from parashift.exec.job import etcd
from parashift.exec.job.endpoint import SECRET_ENV
from parashift.exec.job.etcd_members import ETCD_PACKAGE, Members, etcd_binary
from parashift.exec.jobstore import connect, namespace
from test_hosts_live import _finish, _gone

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd is not installed (Debian package "
                                f"{ETCD_PACKAGE!r}: apt-get install {ETCD_PACKAGE}, or `make install` as root)")
SECRET = "etcd-hosts-secret-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "parashift", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def test_two_hosts_train_on_an_etcd_store_and_one_is_killed(capsys):
    """The first host and an agent (``join --store`` only, no --endpoint) train dp=2 over a store on etcd, keys
    sealed under the job's secret (a key left by an earlier job with that secret is cleared); the agent is
    SIGKILLed mid-run and the first host goes on alone from its own replica. Losses equal the static job's."""
    with Members(1) as m:
        raw = etcd.Etcd(m.url())
        stale = f"parashift/{namespace(SECRET)}/stale"
        raw.put(stale, "from an earlier job")
        url, port = m.url(), _free_port()
        job = ["--model", "tiny-gpt", "--strategy", "dp=2", "--steps", "12", "--global-batch", "8", "--live"]
        first = _host(["run", *job, "--endpoint", f"127.0.0.1:{port}", "--store", url, "--nprocs", "1",
                       "--timeout", "120", "--heartbeat-timeout", "100", "--json"])
        agent = None
        try:
            store = connect(url, 0, SECRET, 60)
            end = time.monotonic() + 90
            while not store.check(["hosts/heartbeat"]):
                assert time.monotonic() < end and first.poll() is None, first.stderr.read()[-2000:]
                time.sleep(0.05)
            assert raw.get(stale) is None                   # cleared by the first host
            agent = _host(["join", "--store", url, "--nprocs", "1", "--timeout", "120"])
            while not store.check(["hosts/loss/5/1"]):         # the agent's device 1 trained its 6th step
                assert time.monotonic() < end and first.poll() is None and agent.poll() is None, "never trained"
                time.sleep(0.01)
            sealed_keys = [k for k, _ in raw.range(f"parashift/{namespace(SECRET)}/", keys_only=True)]
            assert len(sealed_keys) > 10 and not any(b"hosts" in k for k in sealed_keys)
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
            ((rc, out, err),) = _finish([first], 120)
        finally:
            _finish([p for p in (first, agent) if p is not None], 1)
        assert rc == 0, err[-3000:]
        got = json.loads(out)
        assert got["store"] == url and got["hosts"] == {"1": [0]}         # host 2 did not finish
        (sw,) = got["switches"]
        assert sw["cause"] == "failure" and sw["recovered_from"] == "replicas" and sw["lost_devices"] == [1]
        assert SECRET not in out + err
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 12 and got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    with capsys.disabled():
        print(f"\nstore on etcd: the agent's SIGKILL recovered in {sw['seconds']:.2f} s")
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"


def test_cli_store_errors(capsys):
    assert main(["run", "--live", "--strategy", "dp=2", "--store", "etcd://127.0.0.1:2379"]) != 0
    assert "add --endpoint" in capsys.readouterr().err
    assert main(["join", "--nprocs", "1", "--store", "http://127.0.0.1:2379"]) != 0
    assert "etcd://HOST:PORT" in capsys.readouterr().err
