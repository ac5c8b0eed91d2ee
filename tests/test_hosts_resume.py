"""A multi-host live job restarted from its DCP snapshots (``run --live --endpoint ... --resume``): after
its first host (the store) was lost, or to train on past its end, in the same or another layout."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from parashift.cli import main
from parashift.exec.job.endpoint import SECRET_ENV
from test_hosts_live import SECRET, _await_key, _finish, _free_port, _gone, _host

JOB = ["--model", "tiny-gpt", "--global-batch", "8", "--live"]


def _static(steps: int, capsys) -> list[float]:
    assert main(["run", "--model", "tiny-gpt", "--global-batch", "8", "--strategy", "dp=1", "--steps", str(steps),
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)["losses"]


def test_a_job_resumes_from_its_newest_whole_snapshot_in_another_layout(tmp_path, capsys, monkeypatch):
    """dp=2,zero=1 (moments sharded) writes snapshots at steps 2, 4, 6 (the last one before it ends); the
    one of step 6 is made unfinished on one rank, so the restart under dp=1 on one process starts from
    step 4 and trains steps 4-7, equal to the static job's."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    snaps = str(tmp_path / "snaps")
    at = ["--endpoint", f"127.0.0.1:{_free_port()}", "--snapshot-dir", snaps, "--json"]
    assert main(["run", *JOB, "--strategy", "dp=2,zero=1", "--steps", "6", "--nprocs", "2", "--snapshot-every", "2",
                 *at]) == 0
    capsys.readouterr()
    for s in (2, 4, 6):
        for r in (0, 1):
            rec = json.loads((tmp_path / "snaps" / f"step{s}" / f"rank{r}.json").read_text())
            assert rec == {"strategy": "dp=2,tp=1,pp=1,zero=1", "rank": r, "opt_step": s, "model": "tiny-gpt"}
    os.remove(tmp_path / "snaps" / "step6" / "rank1.json")           # rank 1 never finished step 6's
    at[1] = f"127.0.0.1:{_free_port()}"
    assert main(["run", *JOB, "--strategy", "dp=1", "--steps", "8", "--nprocs", "1", "--resume", *at]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["resumed"] == {"step": 4, "strategy": "dp=2,tp=1,pp=1,zero=1"}
    assert got["strategies"] == ["dp=1,tp=1,pp=1"] and len(got["losses"]) == 4
    assert got["losses"] == pytest.approx(_static(8, capsys)[4:], abs=1e-5)


@pytest.mark.parametrize("case,needle", [
    ("missing", "does not exist"),
    ("empty", "holds no step<N> folders"),
    ("partial", "1 of 2 ranks of dp=2,tp=1,pp=1"),
    ("foreign", "step 4: no records"),            # records whose strategy does not parse are skipped
    ("other-model", "snapshots of tiny-moe"),
    ("too-late", "give --steps above 4"),
    ("no-endpoint", "add --endpoint HOST:PORT"),
])
def test_resume_refuses_what_it_cannot_restore(case, needle, tmp_path, capsys, monkeypatch):
    """Each refusal is one line naming the fix, before any process or store starts."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    snaps = tmp_path / "snaps"
    if case != "missing":
        snaps.mkdir()
    if case in ("partial", "other-model", "too-late", "foreign"):
        for r in (0, 1) if case != "partial" else (0,):
            (snaps / "step4" / f"rank{r}").mkdir(parents=True)
            (snaps / "step4" / f"rank{r}.json").write_text(json.dumps(
                {"strategy": "warp=9" if case == "foreign" else "dp=2,tp=1,pp=1", "rank": r, "opt_step": 4,
                 "model": "tiny-moe" if case == "other-model" else "tiny-gpt"}))
    argv = ["run", *JOB, "--strategy", "dp=1", "--steps", "4" if case == "too-late" else "8", "--nprocs", "1",
            "--resume", "--snapshot-dir", str(snaps)]
    if case != "no-endpoint":
        argv += ["--endpoint", f"127.0.0.1:{_free_port()}"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_the_first_host_is_lost_and_the_job_resumes_from_its_snapshots(tmp_path, capsys):
    """SIGKILL of the first host's process group (the store goes with it) mid-run: the agent reports the
    lost store and exits non-zero, nothing is left running; the same two commands with ``--resume`` go
    on from the newest whole snapshot, and the losses from there equal the static job's."""
    snaps = str(tmp_path / "snaps")
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")

    def hosts(extra: list[str]) -> tuple:
        port = _free_port()
        at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", "60", "--nprocs", "1"]
        first = _host(["run", *JOB, "--strategy", "dp=2", "--steps", "14", "--snapshot-every", "2",
                       "--snapshot-dir", snaps, *at, *extra, "--json"], env)
        time.sleep(0.5)
        return port, first, _host(["join", *at], env)

    port, first, agent = hosts([])
    try:
        from parashift.exec.jobstore import connect
        store = connect("127.0.0.1", port, SECRET, 60)
        _await_key(store, "hosts/loss/6/1", [first, agent], "never trained")    # in step 7: snapshots 2, 4, 6 due
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        ((rc, _, err),) = _finish([agent], 60)
    finally:
        for p in (first, agent):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert rc != 0 and "lost the job's store" in err, err[-2000:]
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"
    _, first, agent = hosts(["--resume"])
    (rc1, out1, err1), (rc2, _, err2) = _finish([first, agent], 120)
    assert rc1 == 0 and rc2 == 0, (err1 + err2)[-3000:]
    got = json.loads(out1)
    s = got["resumed"]["step"]
    assert s >= 2 and s % 2 == 0 and len(got["losses"]) == 14 - s
    assert got["losses"] == pytest.approx(_static(14, capsys)[s:], abs=1e-5)
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"
    shutil.rmtree(snaps, ignore_errors=True)
