"""Malformed traces: every error is a TraceFormatError naming the file and the row, with a fix."""
from __future__ import annotations

import json

import pytest

from parashift import traces
from parashift.errors import TraceFormatError


def load_error(tmp_path, name, text, **kw) -> str:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceFormatError) as e:
        traces.load(p, **kw)
    msg = str(e.value)
    assert msg.startswith(str(p)), msg     # names the file
    assert ";" in msg, msg                 # problem; fix
    return msg


SEG = '[{t}, "{op}", {{"nodes": {nodes}}}]'


@pytest.mark.parametrize("name,text,row,words", [
    # unsorted times
    ("ev.csv", "0,add,a\n60000,add,b\n30000,remove,a\n", 3, "comes before"),
    ("gc.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:08:45, 70\n2021-12-10, 13:05:00, 60\n", 3,
     "before"),
    ("gc2.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:06:45, 80\n", 2, "before the observation"),
    ("st.csv", "0,1\n100,1\n50,2\n", 3, "comes before"),
    ("pr.txt", "0,2022-10-26T22:05:04Z,0\n2,2022-10-26T22:15:04Z,1\n1,2022-10-26T22:25:04Z,0\n", 3,
     "tick"),
    ("sg.txt", SEG.format(t=0, op="add", nodes='["a"]') + "\n" + SEG.format(t=9, op="add", nodes='["b"]')
     + "\n" + SEG.format(t=5, op="remove", nodes='["a"]') + "\n" + SEG.format(t=10, op="DONE", nodes="[]")
     + "\n", 3, "comes before"),
    ("dm.out", "[2020-03-15T10:00:00Z] Created instance a with 1 GPU(s) of type v100 in zone z\n"
     "[2020-03-15T09:00:00Z] Instance a running in zone z\n", 2, "comes before"),
    ("pc.csv", "time,event,count,available\n10,add,1,3\n5,preempt,1,2\n", 3, "comes before"),
    # negative counts
    ("neg.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:08:45, -3\n", 2, "negative"),
    ("negs.csv", "0,2\n10,2\n10,-1\n", 3, "negative"),
    ("negc.csv", "time,event,count,available\n10,add,1,3\n20,preempt,-2,1\n", 3, "below 1"),
    ("nega.csv", "time,event,count,available\n10,preempt,3,-1\n", 2, "negative"),
    ("negt.csv", "-5,add,a\n", 1, "negative"),
    # removing what is not there
    ("gone.csv", "0,add,a\n1000,remove,b\n", 2, "not up"),
    ("twice.csv", "0,add,a\n1000,add,a\n", 2, "already up"),
    ("sgone.txt", SEG.format(t=0, op="add", nodes='["a"]') + "\n" + SEG.format(t=9, op="remove", nodes='["b"]')
     + "\n" + SEG.format(t=10, op="DONE", nodes="[]") + "\n", 2, "not up"),
    ("incons.csv", "time,event,count,available\n10,add,1,3\n20,preempt,1,1\n", 3, "available=1"),
    # unknown columns / values
    ("hdr.csv", "time,event,count,available,region\n10,add,1,3\n", 1, "unknown columns in the header (1 of 5)"),
    ("hdr2.csv", "when,what\n10,add\n", 1, "unknown columns"),
    ("wide.csv", "0,add,a\n1000,remove,a,extra\n", 2, "4 fields"),
    ("act.csv", "0,add,a\n1000,drop,a\n", 2, "not 'add' or 'remove'"),
    ("sgkey.txt", '[0, "add", {"nodes": ["a"], "gpu": 4}]\n[10, "DONE", {"nodes": []}]\n', 1,
     "unknown columns"),
    ("sgop.txt", '[0, "add", {"nodes": ["a"]}]\n[10, "explode", {"nodes": []}]\n', 2, "'explode'"),
    ("dmmsg.out", "[2020-03-15T10:00:00Z] Created instance a with 1 GPU(s) of type v100 in zone z\n"
     "[2020-03-15T10:10:00Z] Instance a rebooted\n", 2, "not a known instance event"),
    ("frac.txt", "2021-12-10, 13:07:45, 8.5\n", 1, "whole number"),
    ("nan.csv", "0,add,a\nabc,remove,a\n", 2, "not a number"),
    ("fail2.txt", "0,2022-10-26T22:05:04Z,0\n1,2022-10-26T22:15:04Z,2\n", 2, "not 0 or 1"),
    # truncated files
    ("trunc.csv", "0,add,a\n60000,add,b\n120000,rem", 3, "truncated"),
    ("trunc.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:0", 2, "fields"),
    ("trunc2.txt", "2021-12-10, 13:07:45, 80\n2021-12-10, 13:0, 7", 2, "truncated"),
    ("trunc.seg", '[0, "add", {"nodes": ["a"]}]\n[60000, "remove", {"nodes": ["a"', 2, "truncated"),
    ("nodone.txt", '[0, "add", {"nodes": ["a", "b"]}]\n[60000, "remove", {"nodes": ["a"]}]\n', 2, "DONE"),
    ("trunc.out", "[2020-03-15T10:00:00Z] Created instance a with 1 GPU(s) of type v100 in zone z\n"
     "[2020-03-15T10:1", 2, "truncated"),
])
def test_error_names_row(tmp_path, name, text, row, words):
    msg = load_error(tmp_path, name, text)
    assert f", row {row}:" in msg, msg
    assert words in msg, msg


def test_json_counts_errors_name_the_entry(tmp_path):
    bad = {"metadata": {"gap_seconds": 60}, "data": [3, 2, -1, 4]}
    msg = load_error(tmp_path, "neg.json", json.dumps(bad))
    assert ", row 3:" in msg and "data[2]" in msg and "negative" in msg
    msg = load_error(tmp_path, "cols.json", json.dumps({"metadata": {"gap_seconds": 60}, "data": [1],
                                                        "zone": "x"}))
    assert "unknown columns ['zone']" in msg
    msg = load_error(tmp_path, "gap.json", json.dumps({"metadata": {}, "data": [1]}))
    assert "gap_seconds" in msg
    text = json.dumps({"metadata": {"gap_seconds": 60}, "data": [1, 2, 3]}, indent=1)
    msg = load_error(tmp_path, "cut.json", text[: len(text) // 2])
    assert ", row " in msg and "truncated" in msg


def test_liveput_errors_name_the_interval(tmp_path):
    rec = lambda iv: {"interval": iv, "duration": 60000}  # noqa: E731
    msg = load_error(tmp_path, "gap.json", json.dumps([rec([0, 3, 0]), rec([3, 0, 1]), rec([3, 0, 0])]))
    assert ", row 3:" in msg and "chain" in msg
    msg = load_error(tmp_path, "neg.json", json.dumps([rec([0, 3, 0]), rec([3, -1, 0])]))
    assert ", row 2:" in msg and "negative" in msg
    msg = load_error(tmp_path, "key.json", json.dumps([rec([0, 3, 0]) | {"cost": 1}]))
    assert ", row 1:" in msg and "unknown columns ['cost']" in msg


@pytest.mark.parametrize("text", ["", "\n\n", "   \r\n"])
def test_empty_file(tmp_path, text):
    msg = load_error(tmp_path, "empty.csv", text)
    assert "empty" in msg


def test_comment_only_file(tmp_path):
    msg = load_error(tmp_path, "c.csv", "# nothing here\n", format="event-log")
    assert "no data rows" in msg


def test_undetectable_and_unknown_format(tmp_path):
    msg = load_error(tmp_path, "odd.csv", "1,2,3,4,5\n")
    assert ", row 1:" in msg and "format=" in msg
    p = tmp_path / "ok.csv"
    p.write_text("0,1\n")
    with pytest.raises(TraceFormatError, match="unknown trace format 'xml'"):
        traces.load(p, format="xml")
    with pytest.raises(TraceFormatError, match="time_unit applies only to step-plot"):
        traces.load(p, format="event-log", time_unit="h")


def test_missing_file_and_binary_file(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file"):
        traces.load(tmp_path / "nope.csv")
    p = tmp_path / "bin.csv"
    p.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TraceFormatError, match="not a UTF-8 text file"):
        traces.load(p)


def test_bad_notice(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("0,add,a\n1000,remove,a\n")
    with pytest.raises(TraceFormatError, match="notice"):
        traces.load(p, notice=-1)
