"""The replay report tells the truth: per event the time the switch finished and its lag, a
preemption handled after its notice expired is a failure (text and JSON), the header is wall clock."""
import argparse

import pandas as pd

from parashift.cli.replay import render
from parashift.replay.result import ReplayResult


def _event(time, event, wall, notice=0.13, switched=True):
    return {"time": time, "trace_time": time * 900, "event": event, "count": 1, "devices": 3, "notice": notice,
            "strategy": "dp=3,tp=1,pp=1", "world": 3, "switched": switched, "applied": wall is not None,
            "pause_seconds": 0.02, "lost_seconds": 0.03, "baseline_lost_seconds": None,
            **({"step": 5, "wall_time": wall} if wall is not None else {})}


def _result(events):
    return ReplayResult("tiny-gpt", "switch-aware", "bamboo/p3-trace.csv", 900.0, 0.125, 4, "dp=4,tp=1,pp=1", 1.2,
                        384, events, [5.5, 5.4], [5.5, 5.4], {"param": 0.0}, 0.05, 3.4,
                        pd.DataFrame({"time": [0.0, 1.2], "devices": [4, 4]}))


def test_lag_and_late_per_event_and_the_failure_in_json_and_text(capsys):
    r = _result([_event(0.5, "add", 0.9), _event(1.0, "preempt", 0.95), _event(1.1, "preempt", 1.545),
                 _event(1.15, "preempt", None, switched=False)])
    js = r.to_json()
    ev = js["events"]
    assert [e["lag_seconds"] for e in ev[:3]] == [0.9 - 0.5, 0.95 - 1.0, 1.545 - 1.1] and ev[3]["lag_seconds"] is None
    assert [e["late"] for e in ev] == [False, False, True, False]     # an addition is never late
    assert js["ok"] is False and js["late_preemptions"] == 1 and "0.445 s after" in js["failures"][0]
    assert r.to_frame()["late"].tolist() == [False, False, True, False]
    render(js, argparse.Namespace(max_steps=400))
    text = capsys.readouterr().out
    assert "2 steps in 3.4 s of wall clock (trace window 1.2 s" in text
    assert "done s" in text and "lag ms" in text and "LATE" in text and "FAILED: preempt at 1.10 s" in text
    ok = _result([_event(1.0, "preempt", 0.9)]).to_json()
    assert ok["ok"] and not ok["failures"]
