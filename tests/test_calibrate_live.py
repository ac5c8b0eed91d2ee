"""`parashift calibrate` on live gloo runs: probes execute, the fit completes and the written cost
model is usable. Measured times on a shared CPU are noisy, so only sanity is asserted here; the
recovery of known parameters is tested on simulated timelines (test_calibrate_fit.py)."""
from __future__ import annotations

import json
import math

import pytest

from parashift import cluster as clusters, ir, models, sim
from parashift.calibrate import fit
from parashift.calibrate.probe import run_probes
from parashift.cli import main
from parashift.strategy import Strategy


def test_cli_calibrates_from_live_probes(tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = main(["calibrate", "--runs", "2", "--nprocs", "2", "--steps", "1", "--out", str(out),
               "--save-timelines", str(tmp_path / "tl"), "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    res = json.loads(cap.out)
    assert res["out"] == str(out) and len(res["probes"]) == 2
    assert {"fwd", "bwd", "all"} <= set(res["per_op"]) and math.isfinite(res["median_ape"])
    assert "probe 1/2" in cap.err and "probe 2/2" in cap.err       # progress on stderr
    v = res["verdict"]                                             # each probe predicted by the other's fit
    assert [p["strategy"] for p in v["probes"]] == [p["strategy"] for p in res["probes"]]
    assert all(p["held_out_predicted"] > 0 for p in v["probes"]) and v["text"].startswith("verdict: held-out")
    assert v["ok"] == (v["held_out_ape"] <= 2 * max(v["noise"], 0.01))
    cm = sim.CostModel.load(str(out))
    assert all(math.isfinite(v) and v > 0 for v in res["params"].values())
    assert all(v > 0 for v in cm.efficiency.values()) and cm.link_bw("intra") > 0 and cm.comm_overhead > 0
    # the model simulates a strategy that was not probed
    spec = models.get("tiny-gpt")
    prog = ir.compile(spec, Strategy.parse("pp=2").validate(spec), global_batch=8, seq_len=spec.seq_len)
    assert math.isfinite(sim.simulate(prog, clusters.get("cpu-local"), cm).step_time)
    assert len(list((tmp_path / "tl").glob("probe*.parquet"))) == 2
    # the saved probes fit again offline, to the same model
    again = tmp_path / "again.json"
    assert main(["calibrate", "--from-timelines", str(tmp_path / "tl"), "--out", str(again), "--json"]) == 0
    res2 = json.loads(capsys.readouterr().out)
    assert [p["strategy"] for p in res2["probes"]] == [p["strategy"] for p in res["probes"]]
    assert sim.CostModel.load(str(again)) == cm


def test_fit_on_a_live_pipeline_run_has_finite_positive_parameters():
    runs = run_probes("tiny-gpt", ["pp=2"], steps=2, global_batch=8)
    r = runs[0]
    # the runtime reports every step's time; its profiler keeps (at least) the last step's timeline
    assert len(r.step_times) == 2 and set(r.timeline["step"]) <= {1, 2} and len(r.timeline)
    f = fit([r.timeline], "cpu-local", programs=[r.program])
    assert (f.params["fitted"] > 0).all() and f.params["fitted"].map(math.isfinite).all()
    assert "p2p" in set(f.report["kind"]) and len(f.steps) == 1


def test_cli_errors_are_one_line(tmp_path, capsys):
    rc = main(["calibrate", "--nprocs", "2", "--strategies", "dp=4", "--out", str(tmp_path / "c.json")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "do not use 2 processes" in err and len(err.strip().splitlines()) == 1
    assert main(["calibrate", "--from-timelines", str(tmp_path), "--out", str(tmp_path / "c.json")]) == 1
    assert "no probe*.parquet timelines" in capsys.readouterr().err
    assert main(["calibrate", "--runs", "2"]) == 2  # --out is required
