"""``benchmarks/switch_live_bench.py`` end to end on its small model: the JSON the switch reports in benchmarks/reports/ quote."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    """benchmarks/switch_live_bench.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("switch_live_bench", os.path.join(ROOT, "benchmarks",
                                                                                     "switch_live_bench.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_switch_bench_rounds_report_every_round_and_their_medians():
    """One round end to end (every one-host case, the JSON, the progress line); the medians and ranges
    over rounds (``_merge``, what ``--rounds N`` reports) on that round and a second made from it."""
    # the benchmark itself raises when the state DCP loads differs from the switched one
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "switch_live_bench.py"), "--small", "--repeats", "1",
           "--dcp-repeats", "1", "--rounds", "1", "--set", "one-host"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["rounds"] == 1 and set(out["cases"]) == {"tp2dp2z1->tp4", "tp4->tp2dp2z1", "shrink 4->3"}
    assert "round 1/1: tp2dp2z1->tp4 switch" in p.stderr                                    # progress
    for name, r in out["cases"].items():
        for k in ("switch_seconds", "floor_seconds", "dcp_shm_seconds", "dcp_disk_seconds"):
            assert r[k] > 0, (name, k)
        assert abs(r["vs_floor"] - r["switch_seconds"] / r["floor_seconds"]) < 1e-12
        assert abs(r["vs_dcp_disk"] - r["dcp_disk_seconds"] / r["switch_seconds"]) < 1e-12
        assert r["bytes_moved"] > 0 and r["dst_devices"]
    bench = _bench()
    first = out["cases"]
    second = {n: {k: (3 * v if isinstance(v, float) else v) for k, v in c.items()} for n, c in first.items()}
    merged = bench._merge([first, second])
    assert set(merged) == set(first)
    for name, c in merged.items():
        assert c["rounds"] == [first[name], second[name]]
        for k in ("switch_seconds", "floor_seconds", "dcp_shm_seconds", "dcp_disk_seconds"):
            assert c[k] == (first[name][k] + second[name][k]) / 2, (name, k)        # the median of two
        for k in ("vs_floor", "vs_dcp_disk", "vs_dcp_shm"):
            assert c[f"{k}_range"] == [first[name][k], second[name][k]]
            assert c[k] == pytest.approx(2 * first[name][k])
        assert c["bytes_moved"] == first[name]["bytes_moved"] and c["dst_devices"] == first[name]["dst_devices"]


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
