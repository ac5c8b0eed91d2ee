"""``benchmarks/switch_live_bench.py`` end to end on its small model: the JSON the README quotes."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_switch_bench_rounds_report_every_round_and_their_medians():
    # the benchmark itself raises when the state DCP loads differs from the switched one
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "switch_live_bench.py"), "--small", "--repeats", "1",
           "--dcp-repeats", "1", "--rounds", "2", "--set", "one-host"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["rounds"] == 2 and set(out["cases"]) == {"tp2dp2z1->tp4", "tp4->tp2dp2z1", "shrink 4->3"}
    assert "round 1/2: tp2dp2z1->tp4 switch" in p.stderr and "round 2/2: " in p.stderr   # progress
    for name, c in out["cases"].items():
        assert len(c["rounds"]) == 2
        for k in ("switch_seconds", "floor_seconds", "dcp_shm_seconds", "dcp_disk_seconds"):
            runs = sorted(r[k] for r in c["rounds"])
            assert runs[0] > 0 and c[k] == (runs[0] + runs[1]) / 2, (name, k)
        for k in ("vs_floor", "vs_dcp_disk", "vs_dcp_shm"):
            lo, hi = c[f"{k}_range"]
            assert lo <= c[k] <= hi
        r = c["rounds"][0]
        assert abs(r["vs_floor"] - r["switch_seconds"] / r["floor_seconds"]) < 1e-12
        assert abs(r["vs_dcp_disk"] - r["dcp_disk_seconds"] / r["switch_seconds"]) < 1e-12
        assert r["bytes_moved"] > 0 and r["dst_devices"]


@pytest.mark.slow
def test_switch_bench_two_hosts_move_state_between_the_hosts():
    """The 2-host cases: two process groups joined through the job's store at a loopback endpoint."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "switch_live_bench.py"), "--small", "--repeats", "1",
           "--dcp-repeats", "1", "--set", "two-hosts"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert set(out["cases"]) == {"2 hosts: dp4z1->tp2dp2", "2 hosts: dp2pp2->tp4"}
    for c in out["cases"].values():
        assert c["hosts"] == {"1": [0, 1], "2": [2, 3]}
        assert 0 < c["bytes_cross_host"] <= c["bytes_moved"] and c["vs_dcp_disk"] > 0
    assert out["cases"]["2 hosts: dp2pp2->tp4"]["bytes_cross_host"] == out["cases"]["2 hosts: dp2pp2->tp4"]["bytes_moved"]
