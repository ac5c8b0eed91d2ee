"""``parashift replay TRACE --hosts``: a trace's node events played on real agents (one process group a
node on loopback): SIGTERM where the trace gives a notice, SIGKILL where it gives none, a new agent
for an addition (#20 item 5)."""
import json
import signal

import numpy as np
import pytest

from parashift.cli import main
from parashift.cli.replay import render
from parashift.traces import load
from parashift.traces.csv_formats import write_parashift_csv
from parashift.traces.schema import events_frame, finish


def test_replay_hosts_plays_join_notice_and_kill_on_agents(tmp_path, capsys):
    """The trace planner's strategy per device count (ZeRO-1 where it shards the moments over the
    nodes): the job grows, shrinks and, when a node is killed, restores its newest snapshot into the
    planner's strategy for the one device left."""
    ev = finish(events_frame(np.array([2.0, 8.0, 14.0]), np.array([1, -1, -1]), np.array([3, 2, 1]),
                             np.array([np.nan, 120.0, np.nan])), source="test", fmt="test", initial=2, duration=20.0)
    path = tmp_path / "nodes.csv"
    write_parashift_csv(ev, path)
    assert list(load(str(path))["notice"].isna()) == [True, False, True]      # the file keeps "no notice"
    assert main(["replay", str(path), "--hosts", "--max-steps", "160", "--seconds-per-step", "1",
                 "--global-batch", "12", "--snapshot-every", "4", "--timeout", "300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(a["event"], a.get("signal")) for a in out["applied"]] == [("add", None), ("preempt", "SIGTERM"),
                                                                       ("preempt", "SIGKILL")]
    assert [s["cause"] for s in out["switches"]] == ["join", "notice", "failure"]
    planned = out["planned"]                                   # the job follows the planner at every count
    assert set(planned) == {"1", "2", "3"} and out["policy"] == "switch-aware"
    assert out["strategies"] == [planned["2"], planned["3"], planned["2"], planned["1"]]
    zero = "zero=" in planned["2"]                             # the moments sharded over both nodes
    assert out["switches"][-1]["recovered_from"] == ("snapshot" if zero else "replicas")
    assert out["exit_codes"]["1"] == 0 and out["exit_codes"]["3"] == 0
    assert out["exit_codes"]["2"] == -signal.SIGKILL
    assert len(out["losses"]) == 160 and all(np.isfinite(out["losses"]))
    render(out, None)
    text = capsys.readouterr().out
    assert "SIGKILL" in text and "(failure from " in text and "node 2: -9" in text
    assert "strategy per device count (switch-aware): " in text and f"2: {planned['2']}" in text


def test_replay_hosts_refuses_options_of_the_in_process_replay(capsys):
    assert main(["replay", "bamboo/p3-trace.csv", "--hosts", "--baseline", "checkpoint-restart"]) != 0
    assert "--baseline is not available with --hosts" in capsys.readouterr().err


@pytest.mark.slow
def test_replay_hosts_switches_between_tp_and_pp_layouts(capsys):
    """2 nodes x 2 processes under a strategy per device count (as the trace planner gives it, here
    chosen so that tp and pp change): a preemption with notice switches tp=2,dp=2 -> pp=2 on the
    first node's devices, an addition grows back to tp=2,dp=2 with the new node's, a preemption without
    notice leaves a whole tp=2 replica (recovered from replicas). Losses equal the static job's."""
    from parashift.replay.hosts import replay_hosts
    ev = finish(events_frame(np.array([2.0, 8.0, 14.0]), np.array([-1, 1, -1]), np.array([1, 2, 1]),
                             np.array([120.0, np.nan, np.nan])), source="test", fmt="test", initial=2, duration=20.0)
    got = replay_hosts(ev, devices_per_node=2, steps=120, seconds_per_step=1.0, global_batch=12, timeout=240,
                       strategies={4: "tp=2,dp=2", 2: "pp=2"})
    job = got["job"]
    assert [(a["event"], a.get("signal")) for a in got["applied"]] == [("preempt", "SIGTERM"), ("add", None),
                                                                       ("preempt", "SIGKILL")]
    assert job["strategies"] == ["dp=2,tp=2,pp=1", "dp=1,tp=1,pp=2", "dp=2,tp=2,pp=1", "dp=1,tp=2,pp=1"]
    assert [s["cause"] for s in job["switches"]] == ["notice", "join", "failure"]
    assert job["switches"][-1]["recovered_from"] == "replicas" and job["switches"][-1]["dst_devices"] == [0, 1]
    assert got["exit_codes"][1] == 0 and got["exit_codes"][2] == 0 and got["exit_codes"][3] == -signal.SIGKILL
    assert main(["run", "--model", "tiny-gpt", "--strategy", "tp=2,dp=2", "--steps", "120", "--global-batch", "12",
                 "--live", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(job["losses"]) == 120 and job["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_replay_hosts_a_notice_that_runs_out(capsys):
    """A preemption whose notice (0.5 trace seconds: half a step) runs out long before the switch: the
    replay sends SIGTERM, then SIGKILLs the agent's process group once the notice has run out; the job
    recovers from device 0's replica, and its losses equal the static job's."""
    from parashift.replay.hosts import replay_hosts
    ev = finish(events_frame(np.array([6.0]), np.array([-1]), np.array([1]), np.array([0.5])), source="test",
                fmt="test", initial=2, duration=20.0)
    got = replay_hosts(ev, steps=20, seconds_per_step=1.0, global_batch=8, timeout=150)
    (a,) = got["applied"]
    assert a["signal"] == "SIGTERM" and a["ran_out"] == [2] and 0 < a["notice_seconds"] < 5
    assert got["exit_codes"] == {1: 0, 2: -signal.SIGKILL}
    job = got["job"]
    (fail,) = [s for s in job["switches"] if s["cause"] == "failure"]
    assert fail["recovered_from"] == "replicas" and fail["lost_devices"] == [1]
    assert all("aborted" in s for s in job["switches"] if s["cause"] == "notice")   # begun or not, never finished
    render({"hosts": True, "model": "tiny-gpt", "trace": "test", "seconds_per_step": 1.0, "devices_per_node": 1,
            "applied": got["applied"], "switches": job["switches"], "losses": job["losses"],
            "exit_codes": got["exit_codes"]}, None)
    text = capsys.readouterr().out
    assert "SIGTERM (notice " in text and "SIGKILL when it ran out: node(s) 2" in text and "(failure from replicas)" in text
    assert main(["run", "--model", "tiny-gpt", "--strategy", "dp=2", "--steps", "20", "--live", "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert len(job["losses"]) == 20 and job["losses"] == pytest.approx(ref["losses"], abs=1e-5)
