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


def test_a_failed_snapshot_write_is_recorded_and_training_goes_on(tmp_path, capsys):
    """A snapshot whose data file is on a full disk (/dev/full: ENOSPC, raised by DCP as a BaseException) or whose
    folder is blocked by a file is not recorded, is said on stderr and in ``hosts/snap_failed``, and leaves
    nothing behind; the next snapshot is written. Only the last KEEP written snapshots stay, and a step folder
    another process left behind (a lost rank's) is swept once it is older than those."""
    import os
    import types

    import torch

    from parashift.exec.job import snapshot
    from parashift.exec.switch.stores import STATE_KINDS

    class KV(dict):
        def set(self, k, v):
            self[k] = v
    kv = KV()
    b = types.SimpleNamespace(step=1, **{k: None for k in STATE_KINDS})
    b.param = torch.ones(4)
    state = types.SimpleNamespace(buffers={"x": b})
    root = str(tmp_path)
    os.makedirs(f"{root}/step2/rank0")
    os.symlink("/dev/full", f"{root}/step2/rank0/__0_0.distcp")
    with open(f"{root}/step4", "w") as f:
        f.write("in the way")
    os.makedirs(f"{root}/step0/rank5")                           # a lost process's snapshot
    sn = snapshot.Snapshotter(root, 2)
    for step in range(2, 15):
        if step == 5:
            os.remove(f"{root}/step4")
        sn.maybe(kv, state, "dp=1", 0, 0, step)
    sn.finish(wait=True)
    err = capsys.readouterr().err
    assert "snapshot of step 2" in err and "No space left on device" in err and "snapshot of step 4" in err
    assert {"hosts/snap_failed/2/0", "hosts/snap_failed/4/0"} <= set(kv)
    assert sorted(k for k in kv if k.startswith("hosts/snap/")) == [f"hosts/snap/{s}/0" for s in (10, 12, 14, 6, 8)]
    assert sorted(os.listdir(root)) == ["step10", "step12", "step14"]
