"""The launcher's guarantees, with real processes (the point of these tests): killing it leaves no
process behind, and its store is reachable only on loopback and only with the job's secret."""
import datetime
import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def _session_members(sid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(d))
    return out


def _start(extra):
    cmd = [sys.executable, "-m", "parashift", "run", "--model", "tiny-gpt", "--steps", "100000",
           "--timeout", "120", *extra]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for(proc, text, limit=90.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"the job never printed {text!r}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("when,extra,mark", [
    ("mid-run", ["--strategy", "dp=2"], "step 3/"),
    ("mid-switch", ["--strategy", "dp=2", "--switch-at", "4:dp=1", "--switch-notice", "1"], "step 4/"),
], ids=["mid-run", "mid-switch"])
def test_killing_the_launcher_leaves_no_process(sig, when, extra, mark):
    proc = _start(extra)
    try:
        _wait_for(proc, mark)
        assert len(_session_members(proc.pid)) >= 3   # launcher, forkserver, ranks
        proc.send_signal(sig)
        proc.wait(20)
        end = time.monotonic() + 10
        while _session_members(proc.pid) and time.monotonic() < end:
            time.sleep(0.2)
        assert _session_members(proc.pid) == [], f"{when} {sig.name}: processes left"
    finally:
        for pid in _session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _outside_address() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def test_store_is_loopback_only_and_sealed_by_the_job_secret():
    import torch.distributed as dist

    from parashift.errors import RuntimeFailure
    from parashift.exec.jobstore import connect, serve
    job = serve(5.0)
    job.store.set("verdict", "ok-" + job.secret[:4])
    ip = _outside_address()
    if ip is not None:      # another interface of this machine: nothing listens there
        with pytest.raises(OSError):
            socket.create_connection((ip, job.port), timeout=2).close()
    other = dist.TCPStore("127.0.0.1", job.port, None, False, timeout=datetime.timedelta(seconds=2))
    names = other.list_keys()
    assert names and not any("verdict" in k or job.secret in k for k in names)    # names are opaque
    raw = b"".join(bytes(other.get(k)) for k in names)
    assert b"ok-" not in raw and job.secret.encode() not in raw                    # values are ciphertext
    assert not other.check(["verdict"])
    for k in names:                                                                # a forged value is refused
        other.set(k, b"forged")
    with pytest.raises(RuntimeFailure, match="no member of the job wrote"):
        connect(*job.client_args(), 2.0).get("verdict")
    wrong = connect("127.0.0.1", job.port, "0" * 32, 2.0)                          # a wrong secret names other keys
    wrong.set("verdict", "forged")
    job.store.set("verdict", "ok")
    assert connect(*job.client_args(), 2.0).get("verdict") == b"ok"               # a member with the secret can
    assert wrong.get("verdict") == b"forged" and job.store.get("verdict") == b"ok"
    assert job.store.compare_set("verdict", "no", "x") == b"ok"                    # compare_set sees plaintext
    assert job.store.compare_set("verdict", "ok", "done") == b"done" and job.store.get("verdict") == b"done"
    assert job.store.compare_set("fresh", "", "1") == b"1" and job.store.get("fresh") == b"1"


def test_two_searches_create_one_fresh_sqlite_study_at_once(tmp_path):
    db = f"sqlite:///{tmp_path / 'new.db'}"
    cmd = [sys.executable, "-m", "parashift", "search", "--model", "tiny-gpt", "--cluster", "cpu-local",
           "--global-batch", "8", "--seq-len", "32", "--trials", "3", "--seed", "0", "--storage", db,
           "--study-name", "shared", "--no-progress", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-300:] for o in outs]
    import optuna
    study = optuna.load_study(study_name="shared", storage=db)
    assert len(study.trials) == 6      # both workers wrote their trials into the one study
