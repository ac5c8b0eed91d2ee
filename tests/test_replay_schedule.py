"""Replay planning without processes: scaling, notice, strategies per device count, errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from parashift import traces
from parashift.errors import StrategyError, TraceFormatError
from parashift.replay import DEFAULT_NOTICE, replay_schedule
from parashift.replay.result import lost_per_switch, state_difference

TRACE = """# parashift trace (normalized); columns: time,event,count,available,notice
# initial: 4
# duration: 180
time,event,count,available,notice
60,preempt,2,2,
90,preempt,1,1,10
120,add,3,4,
"""


@pytest.fixture()
def trace_file(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(TRACE)
    return p


def test_events_are_scaled_and_get_a_strategy_that_fits(trace_file):
    s = replay_schedule(trace_file, "tiny-gpt", policy="best", max_procs=4, time_scale=60)
    df = s.to_frame()
    assert list(df["event"]) == ["preempt", "preempt", "add"]
    np.testing.assert_allclose(df["time"], [1.0, 1.5, 2.0])
    assert list(df["devices"]) == [2, 1, 4]
    # unknown notice -> the AWS default, scaled; a recorded one is kept (scaled)
    np.testing.assert_allclose(df["notice"].iloc[:2], [DEFAULT_NOTICE / 60, 10 / 60])
    assert math.isnan(df["notice"].iloc[2]) and df["announce"].iloc[2] == 2.0
    assert df["announce"].iloc[1] == pytest.approx(1.5 - 10 / 60)
    assert df["announce"].iloc[0] == 0.0              # 120 s of notice before t=60 s: from the start
    assert s.duration == 3.0 and s.initial_devices == 4
    assert all(w <= n for w, n in zip(df["world"], df["devices"]))
    for strat, devs in s.layouts():
        assert devs == tuple(range(strat.world))      # device 0 (the clock) is in every layout


def test_shipped_trace_window_fits_the_process_budget():
    s = replay_schedule("bamboo/p3-trace.csv", "tiny-gpt", policy="switch-aware", max_procs=4, time_scale=600,
                        start=0, end=3600, max_events=5)
    most = traces.describe(traces.window(traces.load(traces.resolve("bamboo/p3-trace.csv")), 0, 3600))["max"]
    assert s.devices_per_node == pytest.approx(4 / most)
    assert 1 <= len(s.events) <= 5
    assert all(1 <= e.devices <= 4 and e.world <= e.devices for e in s.events)
    assert s.duration <= 3600 / 600 + 1e-9


def test_bad_input_says_how_to_fix_it(trace_file):
    with pytest.raises(StrategyError, match="best, switch-aware"):
        replay_schedule(trace_file, policy="greedy")
    with pytest.raises(StrategyError, match="max_procs"):
        replay_schedule(trace_file, max_procs=0)
    with pytest.raises(StrategyError, match="time_scale"):
        replay_schedule(trace_file, time_scale=-1)
    with pytest.raises(TraceFormatError, match="no such trace"):
        replay_schedule("no/such/trace.csv")
    with pytest.raises(TraceFormatError, match="no event changes"):
        replay_schedule(trace_file, start=130, end=180)


def test_lost_time_and_state_difference_helpers():
    import pandas as pd
    steps = pd.DataFrame({"step": [0, 0, 1, 1, 2], "start": [0.0, 0.1, 1.0, 1.2, 5.0],
                          "end": [0.5, 0.6, 1.5, 1.7, 6.0]})
    assert lost_per_switch(steps, [1, 2]) == pytest.approx([1.2 - 0.6, 5.0 - 1.7])
    a = {("w", "param"): np.array([1.0, 2.0]), ("w", "exp_avg"): np.array([0.0, 4.0])}
    b = {("w", "param"): np.array([1.0, 2.2]), ("w", "exp_avg"): np.array([0.0, 4.0])}
    d = state_difference(a, b)
    assert d["param"] == pytest.approx(0.2 / 2.2) and d["exp_avg"] == 0.0
