"""Execution timelines: Chrome-trace JSON, parquet and CSV round trips and schema checks."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from parashift import traces
from parashift.errors import TraceFormatError


@pytest.fixture
def timeline():
    rng = np.random.default_rng(0)
    n = 12
    start = np.sort(rng.uniform(0, 0.5, n))
    return pd.DataFrame({
        "device": np.repeat([0, 1, 2], 4),
        "stream": ["compute", "comm", "compute", "p2p"] * 3,
        "id": np.arange(n),
        "op": ["compute", "all_reduce", "compute", "send"] * 3,
        "phase": ["fwd", None, "bwd", None] * 3,
        "microbatch": [0, None, 1, None] * 3,
        "start": start,
        "end": start + rng.uniform(1e-6, 0.1, n),
        "nbytes": [0, 4096, 0, 1 << 20] * 3,
        "flops": [1.5e9, 0.0, 3.0e9, 0.0] * 3,
        "rank_note": ["x"] * n,          # an extra column is kept
    })


@pytest.mark.parametrize("suffix", [".json", ".parquet", ".csv"])
def test_round_trip(tmp_path, timeline, suffix):
    path = traces.save_timeline(timeline, tmp_path / f"tl{suffix}")
    back = traces.load_timeline(path)
    want = traces.check_timeline(timeline)
    assert list(back.columns) == list(want.columns)
    exact = [c for c in want.columns if c not in ("start", "end")]
    pd.testing.assert_frame_equal(back[exact], want[exact])
    np.testing.assert_allclose(back[["start", "end"]].to_numpy(), want[["start", "end"]].to_numpy(),
                               rtol=1e-12, atol=1e-15)
    assert back["microbatch"].dtype == "Int64" and back["device"].dtype == np.int64


def test_chrome_trace_layout(tmp_path, timeline):
    path = traces.save_timeline(timeline, tmp_path / "tl.json")
    obj = json.loads(path.read_text())
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(timeline)
    e = xs[0]
    assert e["pid"] == 0 and e["ts"] == pytest.approx(timeline["start"][0] * 1e6)
    assert e["dur"] == pytest.approx((timeline["end"][0] - timeline["start"][0]) * 1e6)
    names = {(m["pid"], m["tid"]): m["args"]["name"] for m in obj["traceEvents"]
             if m["ph"] == "M" and m["name"] == "thread_name"}
    assert all(names[(x["pid"], x["tid"])] == x["args"]["stream"] for x in xs)
    procs = {m["pid"] for m in obj["traceEvents"] if m["ph"] == "M" and m["name"] == "process_name"}
    assert procs == {0, 1, 2}


def test_format_argument_and_bad_suffix(tmp_path, timeline):
    p = traces.save_timeline(timeline, tmp_path / "tl.data", format="csv")
    assert len(traces.load_timeline(p, format="csv")) == len(timeline)
    with pytest.raises(TraceFormatError, match="cannot tell the timeline format"):
        traces.save_timeline(timeline, tmp_path / "tl.xlsx")


def test_missing_columns_are_named(tmp_path, timeline):
    with pytest.raises(TraceFormatError, match=r"lacks the timeline columns \['nbytes', 'flops'\]"):
        traces.save_timeline(timeline.drop(columns=["nbytes", "flops"]), tmp_path / "a.csv")
    timeline.drop(columns=["op"]).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(TraceFormatError, match=r"b.csv lacks the timeline columns \['op'\]"):
        traces.load_timeline(tmp_path / "b.csv")


def test_bad_values_name_the_row(tmp_path, timeline):
    bad = timeline.copy()
    bad.loc[3, "end"] = bad.loc[3, "start"] - 1
    with pytest.raises(TraceFormatError, match="row 4: end"):
        traces.check_timeline(bad)
    bad = timeline.astype({"nbytes": object})
    bad.loc[5, "nbytes"] = "lots"
    with pytest.raises(TraceFormatError, match="row 6: column 'nbytes'"):
        traces.check_timeline(bad)
    bad = timeline.astype({"microbatch": object})
    bad.loc[0, "microbatch"] = 0.5
    with pytest.raises(TraceFormatError, match="row 1: column 'microbatch'.*whole number"):
        traces.check_timeline(bad)
    bad = timeline.copy()
    bad.loc[2, "stream"] = None
    with pytest.raises(TraceFormatError, match="row 3: column 'stream' is empty"):
        traces.check_timeline(bad)


def test_unreadable_files(tmp_path):
    (tmp_path / "t.json").write_text('{"traceEvents": [{"ph": "X"')
    with pytest.raises(TraceFormatError, match="truncated"):
        traces.load_timeline(tmp_path / "t.json")
    (tmp_path / "n.json").write_text('{"foo": 1}')
    with pytest.raises(TraceFormatError, match="not a Chrome trace"):
        traces.load_timeline(tmp_path / "n.json")
    (tmp_path / "p.parquet").write_bytes(b"not parquet")
    with pytest.raises(TraceFormatError, match="parquet"):
        traces.load_timeline(tmp_path / "p.parquet")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(TraceFormatError, match="CSV"):
        traces.load_timeline(tmp_path / "e.csv")
    with pytest.raises(TraceFormatError, match="no such timeline"):
        traces.load_timeline(tmp_path / "none.csv")


def test_empty_timeline_round_trips(tmp_path, timeline):
    empty = timeline.iloc[:0]
    for suffix in (".json", ".parquet", ".csv"):
        back = traces.load_timeline(traces.save_timeline(empty, tmp_path / f"e{suffix}"))
        assert len(back) == 0 and set(traces.TIMELINE_COLUMNS) <= set(back.columns)


def test_reads_chrome_traces_with_string_tids_and_sparse_args(tmp_path):
    # the layout other writers use: tid = stream name, op in "cat", micro-batch in the name
    events = [{"name": "process_name", "ph": "M", "pid": 3, "args": {"name": "device 3"}},
              {"name": "fwd m2", "cat": "compute", "ph": "X", "pid": 3, "tid": "compute", "ts": 10.0,
               "dur": 5.0, "args": {"rank": 1, "id": 7, "phase": "fwd", "nbytes": 0, "flops": 2.0e9}},
              {"name": "send", "cat": "send", "ph": "X", "pid": 3, "tid": "p2p", "ts": 15.0, "dur": 2.5,
               "args": {"rank": 1, "id": 8, "phase": None, "nbytes": 1024, "flops": 0.0}}]
    (tmp_path / "sim.json").write_text(json.dumps({"traceEvents": events}))
    tl = traces.load_timeline(tmp_path / "sim.json")
    assert tl["stream"].tolist() == ["compute", "p2p"] and tl["op"].tolist() == ["compute", "send"]
    assert tl["microbatch"].tolist() == [2, pd.NA] and tl["rank"].tolist() == [1, 1]
    assert tl["device"].tolist() == [3, 3]
    np.testing.assert_allclose(tl["start"], [10e-6, 15e-6])
    np.testing.assert_allclose(tl["end"], [15e-6, 17.5e-6])
