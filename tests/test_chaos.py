"""A short seeded chaos run (``benchmarks/chaos.py``) of a multi-host live job on loopback hosts."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chaos  # noqa: E402


def test_the_schedule_reproduces_from_its_seed_and_stays_feasible():
    """The same seed draws the same schedule; every drawn event fits the membership it leads to (a notice goes
    to an agent with that notice, no host is removed twice, joins stay within the batch's device counts)."""
    a, _ = chaos.schedule(np.random.default_rng(5), 3, 40, 4, True, True)
    b, _ = chaos.schedule(np.random.default_rng(5), 3, 40, 4, True, True)
    assert a == b and len(a) == 40
    assert a != chaos.schedule(np.random.default_rng(6), 3, 40, 4, True, True)[0]
    ev, notice = chaos.schedule(np.random.default_rng(11), 3, 400, 4, False, False)
    alive = {2, 3}
    for e in ev:
        assert e["type"] not in ("etcd_member", "coordinator")
        if e["type"] == "join":
            alive.add(e["host"])
            assert len(alive) + 1 <= 4
        elif e["type"] in chaos.REMOVES:
            assert e["host"] in alive
            alive.discard(e["host"])
            if e["type"].startswith("notice"):
                assert notice[e["host"]] == e["type"][7:]
    assert {e["type"] for e in ev} >= {"join", "notice_long", "notice_short", "kill", "stall_short", "stall_long",
                                       "snapshot_fail"}
    assert {e.get("moment") for e in ev} >= {"mid-step", "mid-snapshot", "mid-switch", "mid-recovery"}


def test_a_short_chaos_run_survives_every_event():
    """3 hosts, seed 7: a snapshot write that fails (its folder blocked), a short SIGSTOP fired 0-0.3 s after
    it, a long SIGSTOP (declared lost by its heartbeat), then a SIGKILL of the other agent as soon as that
    host is declared (mid-recovery). Every event survived, the short stall not declared, the losses those
    of the static job on every step, both lost hosts reported by failure switches, nothing of the job left
    10 s after its last process exited."""
    out = chaos.main(["--hosts", "3", "--events", "4", "--seed", "7", "--steps", "90", "--json"])
    assert [r["type"] for r in out["records"]] == ["snapshot_fail", "stall_short", "stall_long", "kill"]
    assert out["records"][3]["moment"] == "mid-recovery"
    assert out["survived"] == out["events"] == 4, out["records"]
    assert out["orphans"] == 0, out["orphan_processes"]
    assert out["losses_equal_static"] and out["steps_lost_explained"] and out["losses_not_reported"] == []
    fails = [s for s in out["switches"] if s["cause"] == "failure"]
    assert fails and all(s["recovered_from"] == "replicas" for s in fails)
    assert out["records"][1]["falsely_declared"] is False
    for t in ("snapshot_fail", "stall_long", "kill"):
        assert out["per_type"][t]["detect_seconds"] is not None and out["per_type"][t]["recover_seconds"] > 0
    assert out["ok"]


@pytest.mark.slow
def test_chaos_on_etcd_loses_a_member():
    """The job's store on 3 local etcd members; one member SIGKILLed mid-run (and re-added after)."""
    from parashift.exec.job.etcd_members import etcd_binary
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian package etcd-server)")
    seed = next(s for s in range(100) if "etcd_member" in
                [e["type"] for e in chaos.schedule(np.random.default_rng(s), 3, 3, 4, True, False)[0]])
    out = chaos.main(["--hosts", "3", "--events", "3", "--seed", str(seed), "--store", "etcd", "--json"])
    assert out["survived"] == out["events"] and out["orphans"] == 0 and out["losses_equal_static"], out["records"]
