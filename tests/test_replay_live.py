"""Replaying a trace against a live 4-process job: switches per event, the static job's loss curve
and state, and the checkpoint-restart baseline on the same trace (gloo, tiny model)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from parashift.cli import main
from parashift.replay import EVENT_COLUMNS, replay

# 4 nodes; two are preempted at t=60 s (30 s notice), two come back at t=120 s; the trace ends at 180 s
TRACE = """# parashift trace (normalized); columns: time,event,count,available,notice
# initial: 4
# duration: 180
time,event,count,available,notice
60,preempt,2,2,30
120,add,2,4,
"""


@pytest.fixture()
def trace_file(tmp_path):
    p = tmp_path / "preempt-add.csv"
    p.write_text(TRACE)
    return p


def test_replay_switches_at_each_event_and_matches_the_static_job_and_beats_restart(trace_file, tmp_path):
    res = replay(trace_file, "tiny-gpt", policy="best", max_procs=4, time_scale=90, baseline="checkpoint-restart",
                 max_steps=400, timeout=400, workdir=str(tmp_path))
    ev = res.to_frame()
    assert list(ev.columns) == list(EVENT_COLUMNS)
    assert list(ev["event"]) == ["preempt", "add"] and list(ev["devices"]) == [2, 4]
    assert ev["switched"].all()
    assert list(ev["world"]) == [2, 4]
    assert ev["step"].is_monotonic_increasing and ev["step"].iloc[0] >= 1
    # every event reports its switch: a positive pause no longer than the switch's own phases
    for e in res.events:
        assert 0 < e["pause_seconds"] < 60
        assert e["transfer_seconds"] > 0 and e["plan_seconds"] > 0 and e["bytes_moved"] > 0
        assert e["pause_seconds"] <= e["transfer_seconds"] + e["verify_seconds"] + e["rebuild_seconds"] \
            + e["plan_seconds"] + e["world_seconds"] + 0.25
        assert e["tokens"] == e["step"] * res.tokens_per_step
    # nothing is lost: same losses and final state as a job that never switched
    assert len(res.losses) == len(res.static_losses) > ev["step"].iloc[-1]
    np.testing.assert_allclose(res.losses, res.static_losses, rtol=1e-5, atol=0)
    assert res.losses[-1] < res.losses[0]
    assert set(res.state_difference) >= {"param", "exp_avg", "exp_avg_sq"}
    assert max(res.state_difference.values()) < 1e-5
    # checkpoint-restart: the same switches, the same losses, but far more time lost
    np.testing.assert_allclose(res.baseline_losses, res.static_losses, rtol=1e-5, atol=0)
    assert max(res.extra["baseline_state_difference"].values()) < 1e-5
    assert all(e["baseline_lost_seconds"] > e["lost_seconds"] for e in res.events)
    assert res.baseline_lost_seconds > res.lost_seconds > 0
    assert res.baseline_wall_seconds > res.wall_seconds
    out = json.loads(json.dumps(res.to_json()))
    assert {"events", "losses", "static_losses", "lost_seconds", "baseline_lost_seconds", "lost_ratio"} <= set(out)
    assert out["lost_ratio"] == pytest.approx(out["baseline_lost_seconds"] / out["lost_seconds"])
    assert out["lost_ratio"] > 1
    assert all({"time", "devices", "strategy", "pause_seconds"} <= set(e) for e in out["events"])
    png = res.plot(str(tmp_path / "replay.png"))
    assert (tmp_path / "replay.png").stat().st_size > 10_000 and png.endswith(".png")


def test_cli_replays_a_window_of_a_shipped_trace(tmp_path, capsys):
    # bamboo p3: 18 nodes at the start, the first two events of the first half hour, 4 processes
    rc = main(["replay", "bamboo/p3-trace.csv", "--model", "tiny-gpt", "--strategy-policy", "switch-aware",
               "--max-procs", "4", "--time-scale", "900", "--from", "0", "--to", "1800", "--max-events", "2",
               "--max-steps", "400", "--json", "--table", str(tmp_path / "events.csv")])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "switch-aware" and len(out["events"]) == 2
    assert "baseline_lost_seconds" not in out
    for e in out["events"]:
        assert {"time", "devices", "strategy", "pause_seconds"} <= set(e)
        assert e["applied"]
        if e["switched"]:
            assert e["pause_seconds"] > 0 and math.isfinite(e["lost_seconds"])
    np.testing.assert_allclose(out["losses"], out["static_losses"], rtol=1e-5, atol=0)
    assert (tmp_path / "events.csv").read_text().startswith("time,trace_time,event")
