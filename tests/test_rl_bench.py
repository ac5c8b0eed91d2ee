"""``benchmarks/rl_switch_bench.py`` end to end on its small model."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rl_bench_reports_switch_and_dcp_medians_and_equal_weights():
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "rl_switch_bench.py"), "--small", "--repeats", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert len(out["cases"]) == 3 and "1/1: switch" in p.stderr
    for c in out["cases"].values():
        assert c["rollout_weights_equal"] is True
        assert 0 < c["switch_seconds"] <= c["switch_roundtrip_seconds"]
        assert abs(c["dcp_over_switch"] - c["dcp_seconds"] / c["switch_seconds"]) < 1e-12
