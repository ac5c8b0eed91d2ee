"""Every trace format, read from small files the tests write, into the normalized schema."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from parashift import traces


def write(tmp_path, name, text, newline="\n"):
    p = tmp_path / name
    p.write_bytes(text.replace("\n", newline).encode())
    return p


def rows(df):
    return [(float(t), e, int(c), int(a)) for t, e, c, a in
            df[["time", "event", "count", "available"]].itertuples(index=False)]


def test_schema_columns_and_dtypes(tmp_path):
    df = traces.load(write(tmp_path, "a.csv", "0,add,n1\n60000,remove,n1\n"))
    assert tuple(df.columns) == traces.COLUMNS
    assert df["time"].dtype == np.float64 and df["count"].dtype == np.int64
    assert df["available"].dtype == np.int64 and df["notice"].dtype == np.float64


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_event_log_merges_simultaneous_rows_and_folds_time_zero(tmp_path, newline):
    text = ("0,add,a\n0,add,b\n0,add,c\n60000,remove,a\n60000,remove,b\n60000,add,d\n"
            "120000,add,e\n180000,remove,c\n")
    df = traces.load(write(tmp_path, "bamboo.csv", text, newline))
    assert df.attrs["format"] == "event-log"
    assert df.attrs["initial"] == 3
    assert rows(df) == [(60.0, "preempt", 2, 1), (60.0, "add", 1, 2), (120.0, "add", 1, 3),
                        (180.0, "preempt", 1, 2)]
    assert df["notice"].isna().all()
    assert df.attrs["duration"] == 180.0


def test_event_log_with_header_and_reused_node_name(tmp_path):
    df = traces.load(write(tmp_path, "h.csv", "time_ms,action,node\n0,add,x\n1000,remove,x\n2000,add,x\n"))
    assert df.attrs["format"] == "event-log"
    assert rows(df) == [(1.0, "preempt", 1, 0), (2.0, "add", 1, 1)]


def test_count_series_collapses_echoed_observations(tmp_path):
    # the GCP quirk: each observation echoed one and two minutes later; times step back
    text = """2021-12-10, 13:07:45, 80
2021-12-10, 13:08:45, 80
2021-12-10, 13:09:45, 80
2021-12-10, 13:08:45, 70
2021-12-10, 13:09:45, 70
2021-12-10, 13:10:45, 70
2021-12-10, 13:10:58, 75
2021-12-10, 13:11:58, 75
2021-12-10, 13:12:58, 75
"""
    df = traces.load(write(tmp_path, "v100.txt", text))
    assert df.attrs["format"] == "count-series"
    assert df.attrs["initial"] == 80
    assert df.attrs["start"].startswith("2021-12-10T13:07:45")
    assert rows(df) == [(60.0, "preempt", 10, 70), (193.0, "add", 5, 75)]
    assert df.attrs["duration"] == 313.0


def test_step_plot_seconds_and_hours(tmp_path):
    df = traces.load(write(tmp_path, "s.csv", "0,4\n100,4\n100,2\n250,2\n250,5\n300,5\n"))
    assert df.attrs["format"] == "step-plot" and df.attrs["time_unit"] == "s"
    assert df.attrs["initial"] == 4
    assert rows(df) == [(100.0, "preempt", 2, 2), (250.0, "add", 3, 5)]
    assert df.attrs["duration"] == 300.0
    h = traces.load(write(tmp_path, "h.csv", "0.000,0\n0.500,0\n0.500,3\n1.250,3\n"))
    assert h.attrs["time_unit"] == "h"
    assert rows(h) == [(1800.0, "add", 3, 3)]
    forced = traces.load(write(tmp_path, "m.csv", "0,1\n2,1\n2,0\n"), time_unit="min")
    assert rows(forced) == [(120.0, "preempt", 1, 0)]


def test_step_plot_single_row_has_no_events(tmp_path):
    df = traces.load(write(tmp_path, "one.csv", "0,8\n"))
    assert len(df) == 0 and df.attrs["initial"] == 8
    assert traces.availability(df).to_dict("list") == {"time": [0.0], "available": [8]}


def test_probe_log_inverts_failures(tmp_path):
    text = ("0,2022-10-26T22:05:04.000Z,0\n1,2022-10-26T22:15:04.000Z,1\n"
            "2,2022-10-26T22:25:04.000Z,1\n3,2022-10-26T22:35:04.000Z,0\n")
    df = traces.load(write(tmp_path, "probe.txt", text))
    assert df.attrs["format"] == "probe-log" and df.attrs["initial"] == 1
    assert rows(df) == [(600.0, "preempt", 1, 0), (1800.0, "add", 1, 1)]


def test_json_counts(tmp_path):
    obj = {"metadata": {"gap_seconds": 300}, "data": [4, 4, 1, 1, 3, 0], "prices": [1.0] * 6}
    df = traces.load(write(tmp_path, "sky.json", json.dumps(obj)))
    assert df.attrs["format"] == "json-counts" and df.attrs["initial"] == 4
    assert rows(df) == [(600.0, "preempt", 3, 1), (1200.0, "add", 2, 3), (1500.0, "preempt", 3, 0)]
    assert df.attrs["duration"] == 1800.0


def test_parcae_segment(tmp_path):
    info = ', "duration": 60000, "throughput_opt_strategy": [2, 1], "liveput_truth_strategy": [2, 1], ' \
           '"liveput_predict_strategy": [2, 1]}]'
    text = "\n".join([
        '[0, "add", {"nodes": ["node-0", "node-1", "node-2"]' + info,
        '[60000, "no-op", {"nodes": []' + info,
        '[120000, "remove", {"nodes": ["node-1", "node-2"]' + info,
        '[180000, "migration", {"nodes": []' + info,
        '[240000, "add", {"nodes": ["node-3"]' + info]) + "\n"
    df = traces.load(write(tmp_path, "trace_hh.txt", text))
    assert df.attrs["format"] == "parcae-segment" and df.attrs["initial"] == 3
    assert rows(df) == [(120.0, "preempt", 2, 1), (240.0, "add", 1, 2)]
    assert df.attrs["duration"] == 300.0


def test_spotserve_segment(tmp_path):
    text = """[0, "add", {"nodes": ["node-0", "node-1", "node-2", "node-3"]}]
[120000, "remove", {"nodes": ["node-1"]}]
[210000, "add", {"nodes": ["node-4", "node-5"]}]
[300000, "other", {"nodes": [], "required_tpt": 0.8}]
[330000, "remove", {"nodes": ["node-4", "node-0"], "required_tpt": 0.6}]
[600000, "DONE", {"nodes": []}]
"""
    df = traces.load(write(tmp_path, "seg.txt", text))
    assert df.attrs["format"] == "spotserve-segment" and df.attrs["initial"] == 4
    assert rows(df) == [(120.0, "preempt", 1, 3), (210.0, "add", 2, 5), (330.0, "preempt", 2, 3)]
    assert df.attrs["duration"] == 600.0


def test_parcae_liveput_removes_before_adds(tmp_path):
    rec = lambda iv: {"interval": iv, "duration": 60000, "throughut-opt": [1, 1],  # noqa: E731
                      "liveput-truth": [1, 1], "liveput-predict": [1, 1]}
    obj = [rec([0, 5, 0]), rec([5, 0, 0]), rec([5, 0, 2]), rec([3, 4, 0])]
    df = traces.load(write(tmp_path, "liveput.json", json.dumps(obj, indent=1)))
    assert df.attrs["format"] == "parcae-liveput" and df.attrs["initial"] == 5
    assert rows(df) == [(120.0, "preempt", 2, 3), (180.0, "add", 4, 7)]
    assert df.attrs["duration"] == 240.0


def test_dime_log_tracks_instance_lifecycles(tmp_path):
    text = """[2020-03-15T10:00:00.000Z] Created instance i-a with 1 GPU(s) of type v100 in zone us-east-1b
[2020-03-15T10:00:30.000Z] Created instance i-b with 8 GPU(s) of type k80 in zone us-east-1b
[2020-03-15T10:01:00.000Z] Instance with 8 GPU(s) of type k80 creation failed
[2020-03-15T10:10:00.000Z] Instance i-a running in zone us-east-1b
[2020-03-15T10:10:01.000Z] Instance i-b running in zone us-east-1b
[2020-03-15T10:20:00.000Z] Instance i-a not running in zone us-east-1b
[2020-03-15T10:20:01.000Z] Successfully deleted instance i-a
[2020-03-15T10:21:00.000Z] Instance i-c creation failed
[2020-03-15T10:30:00.000Z] Created instance i-a with 1 GPU(s) of type v100 in zone us-east-1b
"""
    df = traces.load(write(tmp_path, "persistent.out", text))
    assert df.attrs["format"] == "dime-log" and df.attrs["initial"] == 1
    assert rows(df) == [(30.0, "add", 1, 2), (1200.0, "preempt", 1, 1), (1800.0, "add", 1, 2)]
    assert df.attrs["instance_types"] == ["1xv100", "8xk80"]


def test_parashift_csv_round_trip_and_curve(tmp_path):
    src = traces.load(write(tmp_path, "a.csv", "0,add,a\n0,add,b\n5000,remove,a\n9000,add,c\n"),
                      notice=30)
    out = traces.save(src, tmp_path / "norm.csv")
    back = traces.load(out)
    assert back.attrs["format"] == "parashift-csv"
    pd.testing.assert_frame_equal(back, src)
    assert back.attrs["initial"] == 2 and back.attrs["duration"] == src.attrs["duration"]
    curve = traces.availability(src)
    curve.to_csv(tmp_path / "curve.csv", index=False)
    again = traces.load(tmp_path / "curve.csv")
    assert rows(again) == rows(src.assign(notice=np.nan))


def test_notice_fills_only_preemptions(tmp_path):
    df = traces.load(write(tmp_path, "a.csv", "0,add,a\n0,add,b\n5000,remove,a\n9000,add,c\n"), notice=120)
    assert df.loc[df["event"] == "preempt", "notice"].tolist() == [120.0]
    assert df.loc[df["event"] == "add", "notice"].isna().all()


def test_format_override_and_formats_table(tmp_path):
    p = write(tmp_path, "x.dat", "0,3\n10,3\n10,1\n")
    assert traces.load(p, format="step-plot").attrs["initial"] == 3
    table = traces.formats()
    assert set(table.index) == set(traces.FORMATS)
    assert {"event-log", "count-series", "step-plot", "json-counts", "parcae-segment", "spotserve-segment",
            "parcae-liveput", "dime-log", "probe-log", "parashift-csv"} <= set(table.index)


@pytest.mark.parametrize("first,fmt", [
    ("0,add,node1", "event-log"), ("2021-12-10, 13:07:45, 80", "count-series"), ("0,8", "step-plot"),
    ("0.030,9", "step-plot"), ("0,2022-10-26T22:05:04.000Z,0", "probe-log"),
    ('{"metadata": {"gap_seconds": 1}, "data": [1]}', "json-counts"),
    ('[0, "add", {"nodes": ["a"]}]', "spotserve-segment"),
    ('[0, "add", {"nodes": ["a"], "duration": 60000}]', "parcae-segment"),
    ('[{"interval": [0, 1, 0], "duration": 60000}]', "parcae-liveput"), ("[", "parcae-liveput"),
    ("[2020-03-01T10:11:21.000Z] Created instance x", "dime-log"),
    ("time,event,count,available", "parashift-csv"), ("time,available", "parashift-csv"),
])
def test_detect(first, fmt):
    assert traces.detect("# comment\n\n" + first + "\n") == fmt


def test_count_series_tolerates_two_observations_at_one_time(tmp_path):
    text = "2021-12-10, 13:00:00, 10\n2021-12-10, 13:05:00, 6\n2021-12-10, 13:05:00, 8\n"
    df = traces.load(write(tmp_path, "same.txt", text))
    assert rows(df) == [(300.0, "preempt", 4, 6), (300.0, "add", 2, 8)]


def test_parashift_csv_empty_table_needs_initial(tmp_path):
    df = traces.load(write(tmp_path, "e.csv", "# initial: 6\n# duration: 90\ntime,event,count,available\n"))
    assert len(df) == 0 and df.attrs["initial"] == 6 and df.attrs["duration"] == 90.0
    assert traces.availability(df).to_dict("list") == {"time": [0.0, 90.0], "available": [6, 6]}


def test_numpy_scalars_are_accepted(tmp_path):
    df = traces.load(write(tmp_path, "a.csv", "0,add,a\n0,add,b\n5000,remove,a\n"), notice=np.float64(30))
    s = traces.scale(df, np.int64(2), np.int64(8), np.int64(5))
    assert s["devices"].tolist() == [2] and s["notice"].tolist() == [6.0]


def test_changes_at_time_zero_fold_into_the_start(tmp_path):
    df = traces.load(write(tmp_path, "z.csv", "0,0\n0,4\n50,4\n50,3\n50,1\n"))
    assert df.attrs["initial"] == 4
    assert rows(df) == [(50.0, "preempt", 3, 1)]
    assert (df["time"] > 0).all()
