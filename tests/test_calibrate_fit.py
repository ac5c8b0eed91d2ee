"""calibrate.fit on simulated timelines: a known cost model is recovered from what it produced,
with noise and outliers, and parameters no sample informs stay at their base values."""
from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from parashift import calibrate, cluster as clusters, ir, models, sim
from parashift.calibrate import CalibrationError, ape, spearman
from parashift.calibrate.params import Param, get_value
from parashift.errors import TraceFormatError
from parashift.strategy import Strategy

CL = clusters.get("cpu-local")
BASE = sim.CostModel.for_cluster(CL)
SPEC = models.get("tiny-gpt")
STRATEGIES = ("dp=4", "tp=2,dp=2", "dp=2,pp=2", "pp=4,schedule=gpipe", "tp=2,pp=2,zero=1")


@functools.lru_cache(maxsize=None)
def program(text: str, gb: int = 8, seq: int = 32):
    return ir.compile(SPEC, Strategy.parse(text).validate(SPEC), global_batch=gb, seq_len=seq)


def truth_model(eff: float = 0.5, comm: float = 3.0) -> sim.CostModel:
    """BASE with slower compute, costlier comm operations, a slower link and optimizer."""
    return BASE.replace(efficiency={k: v * eff for k, v in BASE.efficiency.items()},
                        comm_overhead=BASE.comm_overhead * comm,
                        latency=dict(BASE.latency, intra=BASE.latency["intra"] / comm),
                        link_efficiency=dict(BASE.link_efficiency, intra=0.3), optim_overhead=3e-3,
                        memory_efficiency=0.5)


def timelines(cm: sim.CostModel, texts=STRATEGIES):
    progs = [program(t) for t in texts]
    return [sim.simulate(p, CL, cm).timeline for p in progs], progs


def fit_uniform(*args, **kw) -> calibrate.Fit:
    """``calibrate.fit`` of the model family the truths below come from: one fixed cost shared by
    every communication operation, instruction samples only (the defaults; per-operation costs and
    the step-time refinement are tested in test_calibrate_steps.py)."""
    return calibrate.fit(*args, **{"per_op": False, "refine": False, **kw})


def fitted(f: calibrate.Fit, name: str) -> float:
    return get_value(f.cost_model, Param.parse(name))


def test_recovers_a_known_cost_model_and_its_step_times():
    truth = truth_model()
    tls, progs = timelines(truth)
    f = fit_uniform(tls, CL, programs=progs)
    for name in ("efficiency.fwd", "efficiency.bwd", "comm_overhead", "link_bw.intra", "latency.intra",
                 "optim_overhead", "memory_efficiency"):
        assert fitted(f, name) == pytest.approx(get_value(truth, Param.parse(name)), rel=0.01), name
    # every sampled instruction costs what the true model says
    pc, pm = calibrate.predict_samples(f.samples, f.cost_model)
    tc, tm = calibrate.predict_samples(f.samples, truth)
    assert np.median(ape(pc, tc)) < 1e-3 and np.median(ape(pm, tm)) < 1e-3
    assert f.median_ape < 0.01 and f.report.set_index("kind").loc["fwd", "base_median_ape"] > 0.3
    # and the simulator reproduces the step times of every strategy
    assert len(f.steps) == len(STRATEGIES)
    np.testing.assert_allclose(f.steps["predicted"], f.steps["measured"], rtol=0.02)
    assert (ape(f.steps["base_predicted"], f.steps["measured"]) > 0.2).all()


def test_the_richer_fit_reproduces_the_step_times_too():
    truth = truth_model()
    tls, progs = timelines(truth)
    f = calibrate.fit(tls, CL, programs=progs, refine=True, per_op=True)
    assert set(f.step_factors) == {"compute", "comm_alpha", "comm_beta"}
    np.testing.assert_allclose(f.steps["predicted"], f.steps["measured"], rtol=0.02)


def test_robust_to_noise_and_outliers():
    truth = truth_model(eff=0.7, comm=2.0)
    tls, progs = timelines(truth)
    rng = np.random.default_rng(0)
    noisy = []
    for tl in tls:
        d = (tl["end"] - tl["start"]).to_numpy()
        factor = np.exp(rng.normal(0.0, 0.05, len(d)))
        factor[rng.random(len(d)) < 0.1] *= 5.0           # 10% of the rows are 5x slow
        noisy.append(tl.assign(end=tl["start"] + d * factor))
    f = fit_uniform(noisy, CL, programs=progs, means=False)
    # (a plain least-squares fit of log times would be ~15% slow; a shortened instruction leaves a
    # gap before the next one, which its cost absorbs, so the fit is ~2% slow by construction)
    for name in ("efficiency.fwd", "efficiency.bwd"):
        assert fitted(f, name) == pytest.approx(get_value(truth, Param.parse(name)), rel=0.05), name
    assert fitted(f, "link_bw.intra") == pytest.approx(truth.link_bw("intra"), rel=0.15)
    assert fitted(f, "comm_overhead") == pytest.approx(truth.comm_overhead, rel=0.15)
    clean = [sim.simulate(p, CL, truth).step_time for p in progs]
    pred = [sim.simulate(p, CL, f.cost_model).step_time for p in progs]
    assert np.max(ape(pred, clean)) < 0.06


def test_means_make_totals_agree_when_the_slow_tail_is_real():
    truth = truth_model()
    tls, progs = timelines(truth, ("tp=2,dp=2", "dp=2,pp=2"))
    rng = np.random.default_rng(1)
    slow = []
    for tl in tls:
        d = (tl["end"] - tl["start"]).to_numpy()
        factor = np.where(rng.random(len(d)) < 0.2, 3.0, 1.0)    # a fifth of everything runs 3x slow
        slow.append(tl.assign(end=tl["start"] + d * factor))
    typical = fit_uniform(slow, CL, programs=progs, means=False)
    f = fit_uniform(slow, CL, programs=progs)
    # the robust fit finds the typical (truth) cost; the means add the tail back
    assert fitted(typical, "efficiency.fwd") == pytest.approx(truth.efficiency["fwd"], rel=0.03)
    assert typical.mean_scales == {} and f.mean_scales["compute:fwd"] > 1.1 and f.mean_scales["comm"] > 1.0
    pc, pm = calibrate.predict_samples(f.samples, f.cost_model)
    c = f.samples.compute.assign(pred=pc)
    m = f.samples.comm.assign(pred=pm)
    for rows in (c[c["phase"] == "fwd"], c[c["phase"] == "bwd"], m):
        ratio = (rows["measured"] / rows["pred"]).to_numpy()
        keep = np.argsort(ratio)[:len(ratio) - len(ratio) // 100]     # all but the top 1%
        assert rows["pred"].iloc[keep].sum() == pytest.approx(rows["measured"].iloc[keep].sum(), rel=1e-3)
    steps = [sim.simulate(p, CL, f.cost_model).step_time for p in progs]
    assert all(s > sim.simulate(p, CL, truth).step_time for s, p in zip(steps, progs))


def test_parameters_no_sample_informs_stay_at_base():
    tls, progs = timelines(truth_model(), ("dp=4", "tp=2,dp=2"))
    f = fit_uniform(tls, CL, programs=progs)
    cm = f.cost_model
    assert cm.latency["inter"] == BASE.latency["inter"] and cm.link_bw("inter") == BASE.link_bw("inter")
    assert cm.region_efficiency["moe"] == BASE.region_efficiency["moe"]
    assert cm.gpu == BASE.gpu and cm.peak_flops == BASE.peak_flops and cm.algorithm == BASE.algorithm
    names = set(f.params["name"][f.params["block"] != "transferred"])
    assert "latency.inter" not in names and "efficiency.recompute" not in names and "efficiency.fwd" in names
    # one factor of each product is the reference: efficiency * region_efficiency is unique
    assert not {"region_efficiency.mlp", "region_efficiency.layer"} <= names


def test_keeps_a_base_model_and_fits_from_there():
    truth = truth_model()
    tls, progs = timelines(truth, ("dp=2,pp=2",))
    base = BASE.replace(latency=dict(BASE.latency, inter=1.234e-3))
    f = fit_uniform(tls, CL, programs=progs, base=base)
    assert f.base is base and f.cost_model.latency["inter"] == 1.234e-3
    assert fitted(f, "efficiency.fwd") == pytest.approx(truth.efficiency["fwd"], rel=0.01)


def test_several_steps_fit_like_one():
    tls, progs = timelines(truth_model(), ("tp=2,dp=2",))
    one = fit_uniform(tls, CL, programs=progs, steps=False)
    two = pd.concat([tls[0].assign(step=0), tls[0].assign(step=1)], ignore_index=True)
    f = fit_uniform([two], CL, programs=progs, steps=False)
    assert len(f.samples.compute) == 2 * len(one.samples.compute)
    assert len(f.samples.comm) == 2 * len(one.samples.comm)
    np.testing.assert_allclose(f.params["fitted"], one.params["fitted"], rtol=1e-4)
    # without a step column, repeated (rank, id) rows are numbered in time order
    later = tls[0].assign(start=tls[0]["start"] + 10.0, end=tls[0]["end"] + 10.0)
    f2 = fit_uniform([pd.concat([tls[0], later], ignore_index=True)], CL, programs=progs, steps=False)
    assert sorted(f2.samples.steps["step"]) == [0, 1]


def test_without_programs_only_compute_is_fitted():
    truth = truth_model()
    tls, progs = timelines(truth, ("dp=4",))
    f = fit_uniform(tls, CL)
    assert f.samples.dropped["comm_without_program"] > 0 and len(f.samples.comm) == 0
    assert set(f.params["block"]) <= {"compute", "transferred"} and "compute" in set(f.params["block"])
    assert f.cost_model.comm_overhead == BASE.comm_overhead
    assert "step" not in set(f.report["kind"])
    assert np.isfinite(f.params["fitted"]).all() and (f.params["fitted"] > 0).all()


def test_fitted_model_round_trips_and_simulates_the_same(tmp_path):
    tls, progs = timelines(truth_model(), ("dp=2,pp=2",))
    f = fit_uniform(tls, CL, programs=progs)
    path = tmp_path / "cost.json"
    f.cost_model.save(str(path))
    loaded = sim.CostModel.load(str(path))
    assert loaded == f.cost_model
    assert sim.simulate(progs[0], CL, loaded).step_time == sim.simulate(progs[0], CL, f.cost_model).step_time
    s = f.summary()
    assert {"median_ape", "step_median_ape", "per_op", "params", "samples", "dropped"} <= set(s)
    assert s["per_op"]["fwd"]["count"] == int((f.samples.compute["phase"] == "fwd").sum())
    assert list(f.report.columns) == ["kind", "count", "median_ape", "mean_ape", "total_ape", "base_median_ape"]
    assert (f.report["total_ape"] < 0.01).all()


def test_bad_inputs_are_explained():
    tls, progs = timelines(truth_model(), ("dp=4",))
    with pytest.raises(CalibrationError, match="no timelines"):
        fit_uniform([], CL)
    with pytest.raises(CalibrationError, match="2 programs for 1 timelines"):
        fit_uniform(tls, CL, programs=[progs[0], progs[0]])
    with pytest.raises(CalibrationError, match="ranks \\[2, 3\\] that its Program lacks"):
        fit_uniform(tls, CL, programs=[program("dp=2")])
    with pytest.raises(TraceFormatError, match="lacks the timeline columns"):
        fit_uniform([tls[0].drop(columns="flops")], CL)
    with pytest.raises(CalibrationError, match="no usable samples"):
        fit_uniform([tls[0].assign(start=0.0, end=0.0)], CL, programs=progs)


def test_ape_and_spearman():
    np.testing.assert_allclose(ape([1.1, 0.9], [1.0, 1.0]), [0.1, 0.1])
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])
    assert np.isnan(spearman([1], [2])) and np.isnan(spearman([1, 1], [1, 2]))


@settings(max_examples=5, deadline=None)
@given(eff=st.floats(0.15, 0.9), comm=st.floats(0.3, 3.0))
def test_recovery_over_random_truths(eff, comm):
    truth = truth_model(eff=eff, comm=comm)
    tls, progs = timelines(truth, ("tp=2,dp=2", "dp=2,pp=2"))
    f = fit_uniform(tls, CL, programs=progs, steps=False)
    assert fitted(f, "efficiency.fwd") == pytest.approx(truth.efficiency["fwd"], rel=0.02)
    assert fitted(f, "comm_overhead") == pytest.approx(truth.comm_overhead, rel=0.02)
    assert fitted(f, "link_bw.intra") == pytest.approx(truth.link_bw("intra"), rel=0.02)


def test_unobserved_phases_follow_their_closest_observed_phase():
    truth = truth_model(eff=0.5)
    tls, progs = timelines(truth, ("dp=2,pp=2",))          # 1f1b: full backward only
    f = fit_uniform(tls, CL, programs=progs)
    moved = f.params[f.params["block"] == "transferred"].set_index("name")["fitted"]
    assert {"efficiency.bwd_input", "efficiency.bwd_weight", "efficiency.recompute"} <= set(moved.index)
    for q, p in (("bwd_input", "bwd"), ("bwd_weight", "bwd"), ("recompute", "fwd")):
        assert f.cost_model.efficiency[q] / BASE.efficiency[q] == pytest.approx(
            f.cost_model.efficiency[p] / BASE.efficiency[p], rel=1e-9)
    # so a zero-bubble schedule, never measured, is predicted with the calibrated backward
    zb = program("dp=2,pp=2,schedule=zb-h1")
    assert sim.simulate(zb, CL, f.cost_model).step_time == pytest.approx(sim.simulate(zb, CL, truth).step_time,
                                                                         rel=0.02)
