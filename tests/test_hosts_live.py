"""Multi-host live jobs on loopback: each "host" is a process group of its own (the first serves the store)."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from parashift.cli import main
from parashift.errors import StrategyError
from parashift.exec.job.endpoint import SECRET_ENV, parse_endpoint, read_secret

SECRET = "hosts-test-secret-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parashift", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _gone(pgid: int, within: float = 10.0) -> bool:
    """No process of group ``pgid`` is left (zombies are reaped by init once their parent is gone)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _await_key(store, key: str, procs: list[subprocess.Popen], what: str, within: float = 90.0) -> None:
    """Poll the job's store for ``key`` while every process in ``procs`` runs."""
    deadline = time.monotonic() + within
    while not store.check([key]):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), what
        time.sleep(0.005)


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


def test_two_hosts_train_a_third_joins_one_leaves_with_notice(capsys):
    """Hosts 1 and 2 (one process each) train dp=2; host 3 (two processes) joins the running job,
    which grows to dp=4 at a step boundary; then host 2 gets SIGTERM (a notice of 600 s) and the job
    shrinks to dp=3 without it. The losses equal the static dp=2 job on one host; every host exits 0.

    The moments are made, not raced (as in :func:`test_a_host_killed_mid_switch`): host 2 is held
    (SIGSTOP, before its process starts: the first world waits for it) until host 3 has registered,
    so the 30-step job cannot end before it grows; host 3 is held once it knows the step it joins at
    (before its processes start: the switch, and so the job, waits for them) until host 2's SIGTERM
    notice is in the store, so the job cannot end before it shrinks. The heartbeat window exceeds
    every hold: a held host is never declared lost by its silence."""
    hold, window = 90.0, 150
    port = _free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", str(window)]
    job = ["--model", "tiny-gpt", "--strategy", "dp=2", "--steps", "30", "--global-batch", "12", "--live"]
    first = _host(["run", *job, "--switch-notice", "1", *at, "--nprocs", "1", "--heartbeat-timeout", str(window),
                   "--json"], env)
    procs = [first]
    try:
        time.sleep(0.5)
        second = _host(["join", *at, "--nprocs", "1", "--notice-seconds", "600"], env)
        procs.append(second)
        _await_line(second, "host 2: devices 1-1, training", "host 2 never got the job")   # the first world is whole
        os.killpg(second.pid, signal.SIGSTOP)
        third = _host(["join", *at, "--nprocs", "2"], env)
        procs.append(third)
        said3 = _await_line(third, "host 3: devices 2-3 announced", "host 3 never came", hold)
        os.killpg(second.pid, signal.SIGCONT)
        if "from step" not in said3:
            said3 += _await_line(third, "from step", "host 3 never joined", hold)
        os.killpg(third.pid, signal.SIGSTOP)            # the switch to dp=4 waits for host 3's processes
        second.send_signal(signal.SIGTERM)
        from parashift.exec.jobstore import connect
        store = connect("127.0.0.1", port, SECRET, 60)
        _await_key(store, "hosts/leave/2", [first, second], "host 2 never gave notice", hold)
        os.killpg(third.pid, signal.SIGCONT)
        (rc1, out1, err1), (rc2, _, err2), (rc3, _, err3) = _finish([first, second, third], 170)
    finally:
        for p in procs:
            if p.poll() is None:        # a failed wait above: nothing is left stopped or running
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert rc1 == 0 and rc2 == 0 and rc3 == 0, (err1 + err2 + said3 + err3)[-3000:]
    got = json.loads(out1)
    assert got["hosts"] == {"1": [0], "2": [1], "3": [2, 3]}
    assert got["strategies"] == ["dp=2,tp=1,pp=1", "dp=4,tp=1,pp=1", "dp=3,tp=1,pp=1"]
    assert got["devices"][1:] == [[0, 1, 2, 3], [0, 2, 3]]
    join, notice = got["switches"]
    assert join["cause"] == "join" and notice["cause"] == "notice" and join["step"] < notice["step"] < 30
    assert "aborted" not in join and "aborted" not in notice
    # planned with the hosts: the joiners' state comes from the other hosts; dp=4 -> dp=3 moves nothing
    assert join["bytes_between_hosts"] > 0 and notice["bytes_between_hosts"] == 0
    assert join["cluster"] == notice["cluster"] == "cpu-local:hosts=1+1+2"      # priced on these hosts
    # device 0 reads the bounded notice (600 s) at the boundary right after the join switch, which it
    # has measured: long enough, so the switch comes --switch-notice + 2 steps later, not at the next step
    assert notice["step"] == join["step"] + 1 + 2
    assert "SIGTERM: devices 1-1 leave" in err2 and "killed 600 s after the SIGTERM" in err2
    assert SECRET not in out1 + err1 + err2 + err3
    # the same job on one host, never switching
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 30
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert all(_gone(p.pid) for p in (first, second, third)), "processes left behind"


def _start_job(strategy: str, nprocs: int, run: list[str], join: list[str]) -> tuple:
    """The first host (``run --live`` of tiny-gpt for 20 steps, with ``run``'s options) and one agent (with
    ``join``'s), ``nprocs`` processes each: (first, agent, a connection to the job's store, the job's options)."""
    from parashift.exec.jobstore import connect
    port = _free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", "150", "--nprocs", str(nprocs)]
    job = ["--model", "tiny-gpt", "--strategy", strategy, "--steps", "20", "--live"]
    first = _host(["run", *job, *at, *run, "--json"], env)
    time.sleep(0.5)
    agent = _host(["join", *at, *join], env)
    return first, agent, connect("127.0.0.1", port, SECRET, 60), job


def _reap(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the process group of every host still running (after a failed wait)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# (strategy, extra options, how the job goes on after host 2 (devices 2-3) is killed)
KILLED = [
    pytest.param("dp=4", [], "replicas", marks=pytest.mark.slow, id="dp=4"),   # every device holds everything
    pytest.param("dp=2,tp=2", [], "replicas", marks=pytest.mark.slow, id="dp=2,tp=2"),   # a whole tp=2 replica survives
    pytest.param("dp=4,zero=1", ["--snapshot-every", "2"], "snapshot", id="dp=4,zero=1"),   # host 2's optimizer shards
    pytest.param("dp=4,zero=1,shard=2", [], "replicas", id="dp=4,zero=1,shard=2"),   # host 1 holds a copy of each shard
    pytest.param("dp=2,pp=2", [], "end", marks=pytest.mark.slow, id="dp=2,pp=2"),   # last stage lost, no snapshot
]


@pytest.mark.parametrize("strategy,extra,path", KILLED)
def test_a_killed_host(strategy, extra, path, capsys, tmp_path):
    """SIGKILL of an agent's whole process group mid-run (2 hosts x 2 processes). The survivors stop
    within seconds (the first failed step interrupts the others' waits), the first host declares the
    host lost as its liveness connection closes (not by its heartbeat: the recovery would then wait
    half the window here, 75 s), and the job goes on on devices 0-1: from the survivors' own copies when
    every cell of the layout survives, else from the newest DCP snapshot (the steps since are re-run
    and reported lost); with neither it ends non-zero naming the host. The losses equal the static
    job's on every step; nothing is left running."""
    first, agent, store, job = _start_job(strategy, 2, [*extra, "--snapshot-dir", str(tmp_path),
                                                       "--heartbeat-timeout", "150"], [])
    _await_key(store, "hosts/loss/4/2", [first, agent], "never trained")      # host 2's device 2 in its 5th step
    t0 = time.monotonic()
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait()
    ((rc, out, err),) = _finish([first], 120)
    assert time.monotonic() - t0 < 90
    if path == "end":
        assert rc == 1 and "host 2 (devices 2-3) stopped beating" in err and "--snapshot-every" in err, err[-2000:]
    else:
        assert rc == 0, err[-2000:]
        got = json.loads(out)
        (sw,) = got["switches"]
        assert sw["cause"] == "failure" and sw["recovered_from"] == path and sw["lost_devices"] == [2, 3]
        said = {r["host"]: r for r in got["survivability"]}          # what the first host said at the start
        assert said[2]["recovers_from"] == path and said[2]["layout"] == sw["dst"] and said[1]["recovers_from"] == "none"
        assert sw["dst_devices"] == [0, 1] and sw["failed_at"] >= 4
        assert sw["seconds"] < 60        # named at once (by the heartbeat, device 0 would wait 75 s)
        if path == "replicas":
            assert sw["steps_lost"] == 0 and sw["step"] == sw["failed_at"]
        else:               # the newest whole snapshot: a multiple of 2 (the newest may be unfinished)
            assert sw["step"] % 2 == 0 and sw["steps_lost"] == sw["failed_at"] - sw["step"] <= 3
        assert main(["run", *job, "--json"]) == 0
        ref = json.loads(capsys.readouterr().out)
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5) and len(got["losses"]) == 20
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        got = kids.get(todo.pop(), [])
        out += got
        todo += got
    return out


def _newest_step(store, device: int) -> int:
    k = 0
    while store.check([f"hosts/loss/{k + 1}/{device}"]):
        k += 1
    return k


# (strategy, extra options, how the job goes on once host 2's notice ran out, when host 2 is held)
SHORT = [
    pytest.param("dp=2", ["--switch-notice", "0"], "replicas", "sw1/noticed/1", id="dp=2"),   # in the switch
    pytest.param("dp=2,zero=1", ["--snapshot-every", "2"], "snapshot", "hosts/gen/1", id="dp=2,zero=1"),  # before it
]


@pytest.mark.parametrize("strategy,extra,path,hold", SHORT)
def test_a_notice_shorter_than_the_switch(strategy, extra, path, hold, capsys, tmp_path):
    """Host 2 (``join --notice-seconds 3``) gets SIGTERM: device 0 reads the deadline and, with no switch
    measured yet, schedules the switch away from host 2 at the next step boundary (not ``--switch-notice``
    + 2 steps ahead); host 2's processes are then held (SIGSTOP: a switch slower than the notice) once
    ``hold`` is in the store: device 1 began the switch (with no notice, in its pause), or device 0
    scheduled it (device 1 is then training or at a step boundary). The notice runs out; the agent
    SIGKILLs its own process group, as the platform would; the notice switch is aborted (or never
    begins) and the job goes on from device 0's replica (dp=2), or from the newest snapshot (ZeRO-1:
    host 2 held half the moments), with the losses of the static job on every step."""
    notice = 3.0
    first, agent, store, job = _start_job(strategy, 1, [*extra, "--snapshot-dir", str(tmp_path),
                                                       "--heartbeat-timeout", "150"], ["--notice-seconds", str(notice)])
    try:
        _await_key(store, "hosts/loss/4/1", [first, agent], "never trained")
        held = _descendants(agent.pid)                   # its forkserver and device 1's process
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        _await_key(store, "hosts/gen/1", [first, agent], "device 0 never scheduled the switch", notice)
        read_at = _newest_step(store, 0) + 1             # device 0's step boundary when it scheduled it
        _await_key(store, hold, [first, agent], f"never {hold}", notice)
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        (rc, out, err), (rc2, _, err2) = _finish([first, agent], 120)
    finally:
        _reap([first, agent])
    assert rc == 0, err[-2000:]
    assert rc2 == -signal.SIGKILL and time.monotonic() - t0 >= notice, err2[-2000:]
    assert f"this host is killed {notice:g} s after the SIGTERM" in err2 and f"notice of {notice:g} s ran out" in err2
    got = json.loads(out)
    (sw,) = [s for s in got["switches"] if s["cause"] == "notice"]
    (fail,) = [s for s in got["switches"] if s["cause"] == "failure"]
    assert "aborted" in sw and sw["dst_devices"] == [0] and sw["step"] <= read_at + 1   # not notice + 2 steps ahead
    assert fail["recovered_from"] == path and fail["lost_devices"] == [1] and fail["dst_devices"] == [0]
    # held in the switch; or (scheduled) in the step before it, unless device 1 had finished that step
    assert fail["failed_at"] == sw["step"] or hold == "hosts/gen/1" and fail["failed_at"] == sw["step"] - 1
    if path == "replicas":
        assert fail["steps_lost"] == 0 and fail["step"] == fail["failed_at"]
    else:
        assert fail["step"] % 2 == 0 and fail["steps_lost"] == fail["failed_at"] - fail["step"] <= 3
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 20 and got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert _gone(first.pid) and _gone(agent.pid), "processes left behind"


def test_a_notice_long_enough(capsys):
    """``join --notice-seconds 60``: the switch away from host 2 finishes well within the notice; the
    switch is the clean ``notice`` one, the agent exits 0 and never kills itself."""
    first, agent, store, job = _start_job("dp=2", 1, [], ["--notice-seconds", "60"])
    try:
        _await_key(store, "hosts/loss/4/1", [first, agent], "never trained")
        agent.send_signal(signal.SIGTERM)
        (rc, out, err), (rc2, _, err2) = _finish([first, agent], 120)
    finally:
        _reap([first, agent])
    assert rc == 0 and rc2 == 0, (err + err2)[-3000:]
    assert "killed 60 s after the SIGTERM" in err2 and "ran out" not in err2
    _assert_clean_notice(out, ["dp=2,tp=1,pp=1", "dp=1,tp=1,pp=1"], job, capsys, [first, agent])


def _assert_clean_notice(out: str, strategies: list[str], job: list[str], capsys, procs) -> None:
    """The first host's JSON has one clean ``notice`` switch through ``strategies``, its 20 losses
    equal the static job's within 1e-5, and no process is left."""
    got = json.loads(out)
    (sw,) = got["switches"]
    assert sw["cause"] == "notice" and "aborted" not in sw and got["strategies"] == strategies
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 20 and got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert all(_gone(p.pid) for p in procs), "processes left behind"


def test_a_kill_after_the_notice_switch_stops_no_step(capsys):
    """Host 2's processes left through a verified notice switch (dp=4 -> dp=2) but its agent is killed
    before it reports (held with SIGSTOP until the survivors trained in the new layout): the host is
    declared lost, and no step stops (its devices wrote ``left/<device>``): no recovery round."""
    import pickle
    first, agent, store, job = _start_job("dp=4", 2, [], ["--notice-seconds", "60"])
    try:
        _await_key(store, "hosts/loss/4/2", [first, agent], "never trained")
        agent.send_signal(signal.SIGTERM)
        _await_key(store, "hosts/leave/2", [first, agent], "host 2 never gave notice")
        os.kill(agent.pid, signal.SIGSTOP)               # the agent alone: its processes switch and exit
        _await_key(store, "hosts/gen/1", [first], "device 0 never scheduled the switch")
        after = pickle.loads(store.get("hosts/gen/1"))[0].step + 1
        _await_key(store, f"hosts/loss/{after}/1", [first], "the survivors never trained in the new layout")
        os.killpg(agent.pid, signal.SIGKILL)
        ((rc, out, err),) = _finish([first], 120)
    finally:
        _reap([first, agent])
    assert rc == 0, err[-2000:]
    _assert_clean_notice(out, ["dp=4,tp=1,pp=1", "dp=2,tp=1,pp=1"], job, capsys, [first, agent])


def test_a_notice_is_short_when_the_switch_would_outlast_it():
    """Device 0 switches at the next step boundary when a notice's time left is under ``notice`` + 2 steps
    and one more (at the last step's duration) plus the last completed switch; with no switch measured, always."""
    from types import SimpleNamespace
    from parashift.exec.job.follow import notice_is_short
    from parashift.exec.switch.protocol import SwitchRecord
    session = SimpleNamespace(records=[], rows=[("train", "step", 0.0, 0.5, 0)], opts=SimpleNamespace(notice=3))
    assert notice_is_short(1e9, session)
    session.records.append(SwitchRecord(4, "dp=2", "dp=1", 0, plan_seconds=1.5, transfer_seconds=0.5))
    assert not notice_is_short(5.01, session) and notice_is_short(4.99, session)      # 6 x 0.5 s + 2 s
    session.records.append(SwitchRecord(8, "dp=1", "dp=2", 0, plan_seconds=9.0, aborted="peer lost"))
    assert not notice_is_short(5.01, session)                # an aborted switch says nothing of the time


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
    assert main(["run", "--live", "--strategy", "dp=2", "--snapshot-every", "2"]) != 0
    assert "add --endpoint" in capsys.readouterr().err
    assert main(["run", "--live", "--strategy", "dp=2", "--heartbeat-timeout", "2"]) != 0
    assert "--heartbeat-timeout is for a multi-host" in capsys.readouterr().err
    assert main(["run", "--live", "--strategy", "dp=2", "--heartbeat-timeout", "0"]) != 0


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), dp=st.integers(1, 3), extra=st.integers(0, 9),
       batch=st.sampled_from([8, 12, 16]))
def test_grow_strategy_is_the_widest_dp_that_fits(tp, pp, dp, extra, batch):
    from parashift import models
    from parashift.exec.job.fit import grow_strategy
    from parashift.strategy import Strategy
    spec = models.get("tiny-gpt")
    cur = Strategy(dp=dp, tp=tp, pp=pp)
    devices = cur.world + extra
    got = grow_strategy(spec, cur, devices, batch)

    def fits(d):
        try:
            cur.replace(dp=d).validate(spec)
        except StrategyError:
            return False
        return batch % d == 0
    want = max((d for d in range(dp + 1, devices // (tp * pp) + 1) if fits(d)), default=None)
    assert (got.dp if got is not None else None) == want
    if got is not None:
        assert (got.tp, got.pp) == (tp, pp) and got.world <= devices


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), dp=st.integers(1, 4), zero=st.sampled_from([0, 0, 1]),
       shard=st.sampled_from([0, 0, 1, 2]), lost=st.sets(st.integers(0, 15)), batch=st.sampled_from([8, 12]))
def test_memory_plan_keeps_each_survivors_shard(tp, pp, dp, zero, shard, lost, batch):
    """Against brute force: the widest dp whose every cell (tp, pp position; under ZeRO also the shard
    index) has that many surviving copies, times the shard group under ZeRO (which stays); each new rank
    sits on a survivor of its own cell; None when a cell is gone."""
    from parashift import models
    from parashift.exec.job.recover import memory_plan, uncovered
    from parashift.strategy import Strategy
    spec = models.get("tiny-gpt")
    try:
        cur = Strategy(dp=dp, tp=tp, pp=pp, zero=zero, shard=shard if zero else 0)
        cur.validate(spec)
    except StrategyError:
        return
    devices = tuple(range(100, 100 + cur.world))          # device ids need not be ranks
    survivors = [d for r, d in enumerate(devices) if r not in lost]
    got = memory_plan(spec, cur, devices, survivors, batch)
    per = cur.shard_size if zero else 1                   # dp ranks holding distinct state
    cell = lambda s, r: (s.coords(r)["tp"], s.coords(r)["pp"], s.coords(r)["dp"] % per)  # noqa: E731
    copies = {c: sum(1 for r, d in enumerate(devices) if d in survivors and cell(cur, r) == c)
              for c in {cell(cur, r) for r in range(cur.world)}}

    def fits(d):
        try:
            cur.replace(dp=d).validate(spec)
        except StrategyError:
            return False
        return batch % (d * cur.mbs) == 0
    lost_ranks = [r for r, d in enumerate(devices) if d not in survivors]
    missing = uncovered(spec, cur, lost_ranks)
    # the VPS layout's own coverage: every piece survives exactly when every cell does
    assert (not missing) == (min(copies.values()) > 0)
    want = None if missing else max((d * per for d in range(1, min(copies.values()) + 1) if fits(d * per)),
                                    default=None)
    assert (got[0].dp if got is not None else None) == want
    if got is not None:
        new, devs = got
        assert len(set(devs)) == new.world and set(devs) <= set(survivors)
        for r, d in enumerate(devs):
            assert cell(new, r) == cell(cur, devices.index(d))


def test_survivability_says_which_host_losses_the_layout_survives():
    from parashift import models
    from parashift.exec.job.recover import survivability
    from parashift.strategy import Strategy
    spec = models.get("tiny-gpt")
    hosts = {1: [0, 1], 2: [2, 3]}
    got = {st: survivability(spec, Strategy.parse(st), hosts, 8, snapshots=snap).set_index("host")
           for st, snap in [("dp=4", False), ("dp=2,tp=2", False), ("dp=4,zero=1", True), ("dp=2,pp=2", False)]}
    assert list(got["dp=4"]["recovers_from"]) == ["none", "replicas"]          # host 1 serves the store
    assert got["dp=2,tp=2"].loc[2, "layout"] == "dp=1,tp=2,pp=1"
    assert got["dp=4,zero=1"].loc[2, ["recovers_from", "missing"]].tolist() == ["snapshot", "exp_avg, exp_avg_sq"]
    assert got["dp=2,pp=2"].loc[2, ["recovers_from", "missing"]].tolist() == ["none", "exp_avg, exp_avg_sq, param"]


def _await_line(p: subprocess.Popen, text: str, what: str, within: float = 90.0) -> str:
    """Read ``p``'s stderr (its file descriptor, so that ``communicate`` reads the rest) until ``text``
    appears while ``p`` runs; returns what was read."""
    fd, got = p.stderr.fileno(), b""
    deadline = time.monotonic() + within
    while text.encode() not in got:
        assert time.monotonic() < deadline and p.poll() is None, f"{what}: {got.decode()[-2000:]}"
        if select.select([fd], [], [], 0.1)[0]:
            got += os.read(fd, 1 << 16)
    return got.decode()


def test_a_host_killed_mid_switch(capsys):
    """Hosts 1 and 2 (two processes each) train dp=4; host 3 joins and the job starts switching to dp=6
    (no notice: the communicators are built in the switch's pause); host 2 is killed in that pause.
    The first host declares it lost (its liveness connection closes), the switch aborts with the
    old layout's state whole, and the survivors recover from their replicas (dp=2 on host 1); host 3's
    processes leave unused. The losses equal the static job's; every remaining host exits 0; nothing is
    left running.

    The moments are made, not raced: host 2 is held (SIGSTOP) until host 3 has registered, so the job
    cannot end before it grows; host 3 is held until devices 0 and 1 took the switch's notice (their
    last dp=4 step done), so the switch, which needs host 3's processes, cannot finish before host 2 is
    killed. Each hold lasts at most ``hold`` seconds, under the heartbeat window: a held host is never
    declared lost by its silence, and host 2 must be declared by its liveness connection (a switch's
    phase may wait 60 s: the kill follows the survivors' arrival in the pause at once)."""
    hold, window = 90.0, 150
    port = _free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", str(window), "--nprocs", "2"]
    job = ["--model", "tiny-gpt", "--strategy", "dp=4", "--steps", "16", "--global-batch", "12", "--live"]
    first = _host(["run", *job, *at, "--switch-notice", "0", "--heartbeat-timeout", str(window), "--json"], env)
    procs = [first]
    try:
        time.sleep(0.5)
        second = _host(["join", *at], env)
        procs.append(second)
        # its liveness connection is up and its processes not yet started: the first world waits for them
        _await_line(second, "host 2: devices 2-3, training", "host 2 never got the job")
        os.killpg(second.pid, signal.SIGSTOP)
        third = _host(["join", *at], env)
        procs.append(third)
        said3 = _await_line(third, "host 3: devices 4-5 announced", "host 3 never came", hold)
        os.killpg(third.pid, signal.SIGSTOP)           # the switch to dp=6 waits for host 3's processes
        released = time.monotonic() + hold
        os.killpg(second.pid, signal.SIGCONT)
        from parashift.exec.jobstore import connect
        store = connect("127.0.0.1", port, SECRET, 60)
        for d in (0, 1):                                # the survivors are in the switch's pause
            _await_key(store, f"sw1/noticed/{d}", [first, second, third], f"device {d} never reached the switch",
                       released - time.monotonic())
        os.killpg(second.pid, signal.SIGKILL)
        second.wait()
        os.killpg(third.pid, signal.SIGCONT)
        (rc1, out1, err1), (rc3, _, err3) = _finish([first, third], 150)
    finally:
        for p in procs:
            if p.poll() is None:        # a failed wait above: nothing is left stopped or running
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert rc1 == 0 and rc3 == 0, (err1 + said3 + err3)[-3000:]
    got = json.loads(out1)
    join, fail = got["switches"]
    assert join["cause"] == "join" and "aborted" in join and join["dst"] == "dp=6,tp=1,pp=1"
    assert fail["cause"] == "failure" and fail["recovered_from"] == "replicas" and fail["step"] == join["step"]
    assert fail["src"] == "dp=4,tp=1,pp=1" and fail["dst_devices"] == [0, 1] and fail["lost_devices"] == [2, 3]
    assert fail["seconds"] < 60         # named at once (by the heartbeat, device 0 would wait half the window, 75 s)
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 16 and got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert all(_gone(p.pid) for p in (first, second, third)), "processes left behind"


class _KV:
    """The store calls snapshots make (set/get/check), in memory."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v if isinstance(v, bytes) else str(v).encode()

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)


def test_snapshot_restores_any_layout(tmp_path):
    """DCP snapshots of every rank of dp=2,zero=1 (optimizer states sharded) restore into other layouts
    exactly: the same global state, the optimizer step kept; a snapshot a rank never finished is not
    whole, so the newest whole one is chosen."""
    import numpy as np
    import torch
    from parashift import models
    from parashift.exec.job.snapshot import Snapshotter, latest, restore
    from parashift.exec.state import StateStore
    from parashift.exec.switch.stores import full_from_arrays, store_arrays
    from parashift.strategy import Strategy
    spec, src = models.get("tiny-gpt"), Strategy.parse("dp=2,zero=1")
    kv = _KV()
    stores = [StateStore(spec, src, r, torch.device("cpu"), seed=0) for r in range(2)]
    for r, s in enumerate(stores):
        for b in s.buffers.values():
            b.step = 4
            b.exp_avg.normal_(generator=torch.Generator().manual_seed(r))    # sharded: differs per rank
        snap = Snapshotter(str(tmp_path), every=2)
        assert not snap.maybe(kv, s, src, r, r, 3) and snap.maybe(kv, s, src, r, r, 4)
        snap.finish(wait=True)
        if r == 0:                                  # a later snapshot only rank 0 finished
            assert snap.maybe(kv, s, src, r, r, 6)
            snap.finish(wait=True)
    assert latest(kv, 2, 2, 7) == (4, str(src), 4)
    want = full_from_arrays(spec, src, {r: store_arrays(s) for r, s in enumerate(stores)})
    for dst in ("dp=1", "tp=2", "dp=2", "dp=4,zero=1,shard=2"):
        st = Strategy.parse(dst)
        got = full_from_arrays(spec, st, {r: store_arrays(restore(str(tmp_path), spec, str(src), 4, st, r, 4))
                                          for r in range(st.world)})
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{dst}: {k}")
    assert {b.step for b in restore(str(tmp_path), spec, str(src), 4, Strategy.parse("dp=1"), 0, 4).buffers.values()} == {4}


@pytest.mark.slow
def test_a_survivor_the_smaller_layout_leaves_out(capsys):
    """Hosts of 1, 2 and 1 processes train dp=4 (global batch 8); host 3 is killed. Three devices
    survive but dp=3 does not divide the batch: the job goes on as dp=2 on devices 0-1, device 2
    (on host 2) stops training, and host 2's agent still exits 0."""
    port = _free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, PYTHONUNBUFFERED="1")
    at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", "150"]
    job = ["--model", "tiny-gpt", "--strategy", "dp=4", "--steps", "16", "--live"]
    first = _host(["run", *job, *at, "--nprocs", "1", "--json"], env)
    time.sleep(0.5)
    second = _host(["join", *at, "--nprocs", "2"], env)
    from parashift.exec.jobstore import connect
    store = connect("127.0.0.1", port, SECRET, 60)
    _await_key(store, "hosts/devices_of/2", [first, second], "host 2 never came")
    third = _host(["join", *at, "--nprocs", "1"], env)
    _await_key(store, "hosts/loss/4/3", [first, second, third], "never trained")
    os.killpg(third.pid, signal.SIGKILL)
    third.wait()
    (rc1, out1, err1), (rc2, _, err2) = _finish([first, second], 150)
    assert rc1 == 0 and rc2 == 0, (err1 + err2)[-3000:]
    got = json.loads(out1)
    (sw,) = got["switches"]
    assert sw["recovered_from"] == "replicas" and sw["dst"] == "dp=2,tp=1,pp=1" and sw["dst_devices"] == [0, 1]
    assert main(["run", *job, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(got["losses"]) == 16 and got["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert all(_gone(p.pid) for p in (first, second, third)), "processes left behind"


@pytest.mark.slow
def test_node_level_replay(capsys):
    """A trace of 2 nodes: a node is added, one is preempted with a notice, one without; each node is a
    host (an agent in a process group of its own). The job grows, shrinks by a switch and recovers
    from replicas; its losses equal the static job's; the preempted-with-notice agent exits 0."""
    import numpy as np
    from parashift.replay.hosts import replay_hosts
    from parashift.traces.schema import events_frame, finish
    ev = finish(events_frame(np.array([2.0, 8.0, 14.0]), np.array([1, -1, -1]), np.array([3, 2, 1]),
                             np.array([np.nan, 120.0, np.nan])), source="test", fmt="test", initial=2, duration=20.0)
    got = replay_hosts(ev, steps=160, seconds_per_step=1.0, global_batch=12, timeout=300)
    job = got["job"]
    assert [a["event"] for a in got["applied"]] == ["add", "preempt", "preempt"]
    assert [a.get("signal") for a in got["applied"]] == [None, "SIGTERM", "SIGKILL"]
    assert job["strategies"] == ["dp=2,tp=1,pp=1", "dp=3,tp=1,pp=1", "dp=2,tp=1,pp=1", "dp=1,tp=1,pp=1"]
    assert [s["cause"] for s in job["switches"]] == ["join", "notice", "failure"]
    assert got["exit_codes"][1] == 0 and got["exit_codes"][3] == 0 and got["exit_codes"][2] == -signal.SIGKILL
    assert main(["run", "--model", "tiny-gpt", "--strategy", "dp=2", "--steps", "160", "--global-batch", "12",
                 "--live", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(job["losses"]) == 160 and job["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_the_strategy_table_decides_joins_leaves_and_snapshot_restores(capsys):
    """``--strategy-for N:STRATEGY`` (the trace planner's choice per device count in ``replay --hosts``):
    a leave or a join switches to the table's strategy of the new count (tp, pp, ZeRO may change); a
    count the table lacks widens or narrows dp; a snapshot restores into the table's strategy, and the
    survivability report says so."""
    from parashift import models
    from parashift.cli.run_hosts import parse_strategy_for
    from parashift.exec.job.fit import next_strategy
    from parashift.exec.job.recover import survivability
    from parashift.strategy import Strategy
    spec = models.get("tiny-gpt")
    table = parse_strategy_for(["4:tp=2,dp=2", "2:pp=2", "2:pp=2,zero=1"], spec, 12)     # the last one of a count wins
    S = Strategy.parse
    assert table == ((2, S("pp=2,zero=1")), (4, S("tp=2,dp=2")))
    assert next_strategy(spec, S("tp=2,dp=2"), 2, 12, table) == S("pp=2,zero=1")               # a leave
    assert next_strategy(spec, S("pp=2"), 4, 12, table, above=2) == S("tp=2,dp=2")             # a join
    assert next_strategy(spec, S("pp=2"), 6, 12, table, above=2) == S("dp=3,pp=2")             # not in the table
    assert next_strategy(spec, S("tp=2,dp=2"), 3, 12, table) == S("tp=2")                       # narrowed dp
    assert next_strategy(spec, S("dp=4"), 4, 12, table, above=4) is None                       # no wider dp of 4
    row = survivability(spec, S("dp=4,zero=1"), {1: [0, 1], 2: [2, 3]}, 12, snapshots=True,
                        table=table).set_index("host").loc[2]
    assert (row["recovers_from"], row["layout"]) == ("snapshot", str(S("pp=2,zero=1")))
    for bad, what in [("3:tp=2", "runs 2 devices, not 3"), ("tp=2", "not N:STRATEGY"), ("0:dp=1", "not N:STRATEGY"),
                      ("4:", "not N:STRATEGY"),
                      ("8:dp=8", "not a multiple of dp x mbs = 8")]:
        with pytest.raises(StrategyError, match=what):
            parse_strategy_for([bad], spec, 12)
    assert main(["run", "--live", "--strategy", "dp=2", "--strategy-for", "2:tp=2"]) != 0
    assert "add --endpoint" in capsys.readouterr().err


def test_joins_and_leaves_keep_tensor_parallel_groups_on_one_host():
    """Hosts of 2, 3 and 3 processes under tp=2: growing onto host 3 uses whole TP pairs of each host
    (dp=3 on 0,1,2,3,5,6: devices 4 and 7 idle) where widening dp over every device would pair 4 with
    5 across hosts 2 and 3; a leave keeps the pairs of the hosts that stay; a strategy-table entry
    whose groups do not fit the hosts falls back to a narrower one that does."""
    from parashift import models
    from parashift.exec.job.fit import choose_devices, host_cells, splits_groups
    from parashift.exec.switch.session import Generation
    from parashift.strategy import Strategy
    spec, S = models.get("tiny-gpt"), Strategy.parse
    hosts = (1, 1, 2, 2, 2, 3, 3, 3)
    assert host_cells(range(8), hosts, 2) == [0, 1, 2, 3, 5, 6]
    assert host_cells((5, 0, 6, 1, 7), hosts, 2) == [5, 6, 0, 1]       # hosts in order of their first device
    cur = Generation(3, S("tp=2,dp=2"), (0, 1, 2, 3))
    st, devs = choose_devices(spec, cur, (0, 1, 2, 3, 4, 5, 6, 7), hosts, 12, grow=True)
    assert (st, devs) == (S("tp=2,dp=3"), (0, 1, 2, 3, 5, 6))
    assert all(hosts[a] == hosts[b] for a, b in zip(devs[::2], devs[1::2]))
    assert not splits_groups(st, devs, hosts) and splits_groups(S("tp=2,dp=4"), range(8), hosts)  # the first host warns
    big = Generation(9, st, devs)
    assert choose_devices(spec, big, (0, 1, 5, 6), hosts, 12) == (S("tp=2,dp=2"), (0, 1, 5, 6))   # host 2 left
    assert choose_devices(spec, cur, (0, 1, 2, 3, 4), hosts, 12, grow=True) is None   # no wider layout on whole pairs
    table = ((4, S("tp=4")),)               # 4 devices for tp=4, but no host holds four
    assert choose_devices(spec, big, (0, 1, 5, 6), hosts, 12, table) == (S("tp=2,dp=2"), (0, 1, 5, 6))


def test_the_first_hosts_text_report_names_each_kind_of_switch(capsys):
    """Without --json the first host prints every switch: a planned one with its cause and the bytes
    between hosts, one that never began, and a recovery (whose entry has no phase timings)."""
    from parashift.cli.run_live import render_cli
    planned = dict(step=3, src="dp=2", dst="dp=4", src_devices=[0, 1], dst_devices=[0, 1, 2, 3], seconds=0.2,
                   pause_seconds=0.05, plan_seconds=0.1, world_seconds=0.02, transfer_seconds=0.01,
                   verify_seconds=0.01, rebuild_seconds=0.001, bytes_moved=2**21, peak_bytes=2**22, stages=1,
                   released_bytes=0, fits=True, cause="join", bytes_between_hosts=2**20)
    never = {"step": 9, "src": "dp=4", "dst": "dp=3", "src_devices": [0, 1, 2, 3], "dst_devices": [0, 2, 3],
             "seconds": 0.0, "pause_seconds": 0.0, "aborted": "never began: devices [1] were lost before it",
             "cause": "notice"}
    failure = {"step": 8, "src": "dp=4", "dst": "dp=2", "src_devices": [0, 1, 2, 3], "dst_devices": [0, 2],
               "cause": "failure", "lost_devices": [1, 3], "failed_at": 8, "recovered_from": "replicas",
               "steps_lost": 0, "seconds": 0.3, "pause_seconds": 0.3}
    render_cli({"model": "tiny-gpt", "strategy": "dp=2", "nprocs": 2, "losses": [5.5, 5.4],
                "switches": [planned, failure, never]})
    out = capsys.readouterr().out.splitlines()
    assert "step    3 (join): dp=2 on [0,1] -> dp=4 on [0,1,2,3]" in out[2] and "(1.0 between hosts)" in out[2]
    assert out[3] == ("  step    8: devices [1,3] lost at step 8: dp=4 on [0,1,2,3] -> dp=2 on [0,2], recovered from "
                      "replicas, 0 steps lost, pause 300 ms")
    assert out[4].endswith("ABORTED: never began: devices [1] were lost before it") and "(notice)" in out[4]
