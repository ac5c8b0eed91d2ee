"""Calibration from a table of measured step times (parashift.calibrate.measured)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from parashift import cluster as clusters
from parashift.calibrate import CalibrationError, fit_measured, holdout_measured
from parashift.calibrate.measured import render_measured
from parashift.cli import main
from parashift.cost import CostModel
from parashift.ir import compile as ir_compile
from parashift import models
from parashift.sim import simulate
from parashift.strategy import Strategy

MODEL = "gpt:layers=4,hidden=4096,heads=32,seq_len=1024"
RUNS = [("dp=8,mbs=2", 32), ("dp=2,tp=4,mbs=2", 32), ("dp=4,pp=2,mbs=1", 32), ("dp=16,mbs=1", 32),
        ("dp=2,tp=8,mbs=2", 16)]
CL = clusters.get("a100-2x8")


def _table(truth: CostModel) -> pd.DataFrame:
    m = models.get(MODEL)
    rows = []
    for strat, gb in RUNS:
        p = ir_compile(m, Strategy.parse(strat), global_batch=gb, seq_len=1024)
        rows.append({"model": MODEL, "strategy": strat, "global_batch": gb, "seq_len": 1024,
                     "step_seconds": simulate(p, CL, truth, model=m).step_time})
    return pd.DataFrame(rows)


def test_fit_recovers_compute_and_link_terms_from_step_times():
    base = CostModel.for_cluster(CL)
    truth = base.replace(gemm_efficiency=0.55, link_efficiency={**base.link_efficiency, "inter": 0.45})
    f = fit_measured(_table(truth), CL)
    assert f.rows["base_ape"].max() > 0.1          # the preset is off on this "cluster"
    assert f.median_ape < 0.02 and f.rows["ape"].max() < 0.1
    assert (f.rows["ape"] <= f.rows["base_ape"] + 1e-9).all()
    assert list(f.params["stage"].unique()) == ["compute", "intra", "inter"]  # each link class fitted apart
    assert f.cost_model.gemm_efficiency == pytest.approx(0.55, rel=0.25)


def test_measured_table_errors_name_the_problem(tmp_path):
    with pytest.raises(CalibrationError, match="lack columns"):
        fit_measured(pd.DataFrame({"model": ["tiny-gpt"]}), CL)
    bad = _table(CostModel.for_cluster(CL)).iloc[:1].assign(step_seconds=-1.0)
    with pytest.raises(CalibrationError, match="positive seconds"):
        fit_measured(bad, CL)
    wrong = bad.assign(step_seconds=1.0, strategy="dp=64")
    with pytest.raises(CalibrationError, match="row 1"):
        fit_measured(wrong, CL)


def test_cli_calibrate_measured_writes_a_usable_cost_model(tmp_path, capsys):
    truth = CostModel.for_cluster(CL).replace(gemm_efficiency=0.6)
    csv = tmp_path / "runs.csv"
    _table(truth).iloc[[0, 2]].to_csv(csv, index=False)
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--measured", str(csv), "--cluster", "a100-2x8", "--out", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["median_ape"] < 0.05 and len(res["rows"]) == 2
    cm = CostModel.load(str(out))
    assert main(["simulate", "--model", MODEL, "--cluster", "a100-2x8", "--strategy", "dp=8,mbs=2",
                 "--global-batch", "32", "--seq-len", "1024", "--cost-model", str(out), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert np.isclose(sim["step_time"], res["rows"][0]["predicted"], rtol=1e-6)
    assert cm.gemm_efficiency != CostModel.for_cluster(CL).gemm_efficiency



def test_holdout_predicts_each_row_from_the_others(capsys, tmp_path):
    """On a cluster that really is one cost model, a row left out is predicted by the fit on the rest."""
    truth = CostModel.for_cluster(CL).replace(gemm_efficiency=0.55)
    table = _table(truth).iloc[:2]
    with pytest.raises(CalibrationError, match="at least two"):
        holdout_measured(table.iloc[:1], CL)
    csv = tmp_path / "runs.csv"
    table.to_csv(csv, index=False)
    args = ["calibrate", "--measured", str(csv), "--cluster", "a100-2x8", "--out", str(tmp_path / "c.json"),
            "--holdout"]
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    h = res["holdout"]
    assert [r["strategy"] for r in h["rows"]] == list(table["strategy"])
    assert all(r["held_out_ape"] < 0.05 for r in h["rows"])          # base is off by > 10% (first test)
    render_measured(res)
    assert "held out (each row predicted by the fit on the others)" in capsys.readouterr().out
    assert main(["calibrate", "--holdout", "--out", str(tmp_path / "d.json")]) != 0
    assert "--holdout applies to --measured" in capsys.readouterr().err
