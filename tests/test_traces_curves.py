"""availability, window, describe and scale on hand-built and generated traces."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parashift import traces
from parashift.errors import TraceFormatError


def event_log(tmp_path, text, name="t.csv", **kw):
    p = tmp_path / name
    p.write_text(text)
    return traces.load(p, **kw)


@pytest.fixture
def trace(tmp_path):
    # 4 nodes at 0; -2 at 60 s; +1 at 120 s; -1 at 120 s; +3 at 300 s; -2 at 400 s
    return event_log(tmp_path, "0,add,a\n0,add,b\n0,add,c\n0,add,d\n60000,remove,a\n60000,remove,b\n"
                     "120000,add,e\n120000,remove,c\n300000,add,f\n300000,add,g\n300000,add,h\n"
                     "400000,remove,d\n400000,remove,e\n", notice=30)


def test_availability_curve(trace):
    curve = traces.availability(trace)
    assert curve.to_dict("list") == {"time": [0.0, 60.0, 120.0, 120.0, 300.0, 400.0],
                                     "available": [4, 2, 3, 2, 5, 3]}
    trace.attrs["duration"] = 500.0
    assert traces.availability(trace)["time"].iloc[-1] == 500.0


def test_describe(trace):
    d = traces.describe(trace)
    assert (d["initial"], d["min"], d["max"], d["preemptions"], d["nodes_lost"], d["largest_loss"],
            d["additions"], d["nodes_gained"]) == (4, 2, 5, 3, 5, 2, 2, 4)
    # time-weighted mean: 4*60 + 2*60 + 2*180 + 5*100 over 400 s
    assert d["mean"] == pytest.approx((240 + 120 + 360 + 500) / 400)


def test_window_folds_events_before_start_and_rebases(trace):
    w = traces.window(trace, 60, 300)
    assert w.attrs["initial"] == 2 and w.attrs["offset"] == 60 and w.attrs["duration"] == 240
    assert w["time"].tolist() == [60.0, 60.0, 240.0]
    assert w["available"].tolist() == [3, 2, 5]
    whole = traces.window(trace, 0)
    pd.testing.assert_frame_equal(whole, trace)
    nested = traces.window(w, 100, 240)
    assert nested.attrs["offset"] == 160 and nested.attrs["initial"] == 2
    assert traces.window(trace, 60, 300, rebase=False)["time"].tolist() == [120.0, 120.0, 300.0]
    with pytest.raises(TraceFormatError, match="window"):
        traces.window(trace, 100, 50)


def test_scale_merges_caps_and_compresses(trace):
    s = traces.scale(trace, devices_per_node=2, max_devices=6, time_scale=10)
    assert tuple(s.columns) == traces.SCALED_COLUMNS
    assert s.attrs["initial_devices"] == 6                  # 4 nodes * 2 capped at 6
    # 60 s: 2 nodes -> 4 devices; 120 s: +1 -1 -> net 2 nodes (no change, dropped);
    # 300 s: 5 nodes -> 10 capped 6; 400 s: 3 nodes -> 6 (no change, dropped)
    assert s[["time", "trace_time", "event", "count", "devices"]].values.tolist() == [
        [6.0, 60.0, "preempt", 2, 4], [30.0, 300.0, "add", 2, 6]]
    assert s["notice"].iloc[0] == pytest.approx(3.0) and np.isnan(s["notice"].iloc[1])
    assert s.attrs["duration"] == pytest.approx(40.0)


def test_scale_keeps_at_least_one_device(tmp_path):
    t = event_log(tmp_path, "0,add,a\n1000,remove,a\n2000,add,b\n")
    s = traces.scale(t, devices_per_node=4, max_devices=8, time_scale=1)
    assert s.attrs["initial_devices"] == 4
    assert s["devices"].tolist() == [1, 4] and s["count"].tolist() == [3, 3]


def test_scale_min_gap_merges_chains(tmp_path):
    t = event_log(tmp_path, "0,add,a\n0,add,b\n0,add,c\n10000,remove,a\n12000,remove,b\n"
                  "14000,add,d\n100000,remove,c\n", notice=60)
    s = traces.scale(t, 1, 8, time_scale=1, min_gap=3)
    # 10, 12, 14 s chain (gaps of 2 s < 3 s) -> one event at 14 s with the net change -1
    assert s[["time", "event", "count", "devices"]].values.tolist() == [
        [14.0, "preempt", 1, 2], [100.0, "preempt", 1, 1]]
    assert s["notice"].tolist() == [60.0, 60.0]


def test_scale_fractional_devices_per_node(tmp_path):
    # 12 nodes, then 9, then 7, then 12; 0.25 devices per node: floor -> 3, 2, 1, 3 devices
    t = event_log(tmp_path, "".join(f"0,add,n{i}\n" for i in range(12))
                  + "".join(f"60000,remove,n{i}\n" for i in range(3))
                  + "120000,remove,n3\n120000,remove,n4\n"
                  + "".join(f"180000,add,m{i}\n" for i in range(5)))
    s = traces.scale(t, devices_per_node=0.25, max_devices=4, time_scale=60)
    assert s.attrs["initial_devices"] == 3
    assert s[["time", "devices", "count"]].values.tolist() == [[1.0, 2, 1], [2.0, 1, 1], [3.0, 3, 2]]


@pytest.mark.parametrize("kw", [dict(devices_per_node=0), dict(max_devices=0), dict(time_scale=0),
                                dict(time_scale=float("nan")), dict(min_gap=-1), dict(devices_per_node=-0.5),
                                dict(max_devices=2.5), dict(devices_per_node=float("inf"))])
def test_scale_rejects_bad_arguments(trace, kw):
    args = dict(devices_per_node=1, max_devices=4, time_scale=1.0) | kw
    with pytest.raises(TraceFormatError):
        traces.scale(trace, **args)


def test_check_rejects_broken_frames(trace):
    with pytest.raises(TraceFormatError, match="lacks columns"):
        traces.availability(trace.drop(columns="notice"))
    bad = trace.copy()
    bad.loc[2, "available"] = 7
    with pytest.raises(TraceFormatError, match="row 3"):
        traces.scale(bad, 1, 4, 1.0)
    bad = trace.iloc[::-1].reset_index(drop=True)
    with pytest.raises(TraceFormatError, match="sort"):
        traces.window(bad, 0, 10)


@st.composite
def count_series(draw):
    n = draw(st.integers(1, 40))
    counts = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(1, 600), min_size=n, max_size=n))
    return counts, np.cumsum(gaps) - gaps[0]


@settings(max_examples=60, deadline=None)
@given(series=count_series(), dpn=st.integers(1, 4), cap=st.integers(1, 16),
       ts=st.sampled_from([1.0, 7.5, 600.0]))
def test_properties_of_curves_and_scale(tmp_path_factory, series, dpn, cap, ts):
    counts, times = series
    d = tmp_path_factory.mktemp("h")
    p = d / "s.csv"
    p.write_text("".join(f"{t},{c}\n" for t, c in zip(times, counts)))
    df = traces.load(p)
    traces.check(df)
    curve = traces.availability(df)
    assert (curve["available"] >= 0).all()
    # the curve reproduces the input at every sample time
    idx = np.searchsorted(curve["time"].to_numpy(), times, side="right") - 1
    assert curve["available"].to_numpy()[idx].tolist() == counts
    s = traces.scale(df, dpn, cap, ts)
    dev = np.concatenate([[s.attrs["initial_devices"]], s["devices"].to_numpy()])
    assert ((dev >= 1) & (dev <= cap)).all()
    assert (np.diff(dev) != 0).all() and (s["count"] > 0).all()
    assert (np.diff(s["time"].to_numpy()) > 0).all()
    final = min(max(counts[-1] * dpn, 1), cap)
    assert dev[-1] == final
    # a window starting at a sample time starts with that sample's count
    k = len(times) // 2
    if times[k] < times[-1]:
        w = traces.window(df, float(times[k]), float(times[-1]))
        assert w.attrs["initial"] == curve["available"].to_numpy()[idx[k]]
