"""``parashift replay TRACE --hosts``: a trace's node events played on real agents (one process group a
node on loopback): SIGTERM where the trace gives a notice, SIGKILL where it gives none, a new agent
for an addition (#20 item 5)."""
import json
import signal

import numpy as np

from parashift.cli import main
from parashift.cli.replay import render
from parashift.traces import load
from parashift.traces.csv_formats import write_parashift_csv
from parashift.traces.schema import events_frame, finish


def test_replay_hosts_plays_join_notice_and_kill_on_agents(tmp_path, capsys):
    ev = finish(events_frame(np.array([2.0, 8.0, 14.0]), np.array([1, -1, -1]), np.array([3, 2, 1]),
                             np.array([np.nan, 30.0, np.nan])), source="test", fmt="test", initial=2, duration=20.0)
    path = tmp_path / "nodes.csv"
    write_parashift_csv(ev, path)
    assert list(load(str(path))["notice"].isna()) == [True, False, True]      # the file keeps "no notice"
    assert main(["replay", str(path), "--hosts", "--max-steps", "160", "--seconds-per-step", "1",
                 "--global-batch", "12", "--timeout", "300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(a["event"], a.get("signal")) for a in out["applied"]] == [("add", None), ("preempt", "SIGTERM"),
                                                                       ("preempt", "SIGKILL")]
    assert [s["cause"] for s in out["switches"]] == ["join", "notice", "failure"]
    assert out["switches"][-1]["recovered_from"] == "replicas"
    assert out["strategies"] == ["dp=2,tp=1,pp=1", "dp=3,tp=1,pp=1", "dp=2,tp=1,pp=1", "dp=1,tp=1,pp=1"]
    assert out["exit_codes"]["1"] == 0 and out["exit_codes"]["3"] == 0
    assert out["exit_codes"]["2"] == -signal.SIGKILL
    assert len(out["losses"]) == 160 and all(np.isfinite(out["losses"]))
    render(out, None)
    text = capsys.readouterr().out
    assert "SIGKILL" in text and "(failure from replicas)" in text and "node 2: -9" in text


def test_replay_hosts_refuses_options_of_the_in_process_replay(capsys):
    assert main(["replay", "bamboo/p3-trace.csv", "--hosts", "--baseline", "checkpoint-restart"]) != 0
    assert "--baseline is not available with --hosts" in capsys.readouterr().err
