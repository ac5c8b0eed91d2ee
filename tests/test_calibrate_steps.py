"""Step-level calibration: scales recovered from simulated step times, posted send/recv read off
timelines, and per-operation communication costs recovered by the instruction-level fit."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from parashift import calibrate, cluster as clusters, ir, models, sim
from parashift.calibrate import CalibrationError, ape
from parashift.calibrate.fit import posts_p2p, with_op_terms
from parashift.calibrate.steps import fit_steps, scaled
from parashift.strategy import Strategy

CL = clusters.get("cpu-local")
BASE = sim.CostModel.for_cluster(CL).replace(comm_overhead=5e-4)
SPEC = models.get("tiny-gpt")
TEXTS = ("dp=4", "tp=2,dp=2", "dp=2,pp=2", "pp=4", "dp=2,pp=2,zero=1")


@functools.lru_cache(maxsize=None)
def program(text: str):
    return ir.compile(SPEC, Strategy.parse(text).validate(SPEC), global_batch=8, seq_len=32)


def step_times(cm: sim.CostModel, texts=TEXTS) -> list[float]:
    return [sim.simulate(program(t), CL, cm).step_time for t in texts]


def test_scaled_moves_each_group_by_its_factor():
    p = program("dp=4")
    ins = next(i for i in p.ranks[0].instrs() if i.op == "compute" and i.phase == "fwd")
    cm = scaled(BASE, {"compute": 2.0, "comm_alpha": 3.0, "comm_beta": 4.0})
    assert cm.compute_time(ins) == pytest.approx(2.0 * BASE.compute_time(ins))
    ph = BASE.collective_phases("all_reduce", 1e6, (4, 1, 4, False))
    alpha = BASE.comm_overhead + sum(x.latency for x in ph)
    beta = sum(x.nbytes / BASE.link_bw(x.link) for x in ph)
    got = cm.op_time("all_reduce", cm.collective_phases("all_reduce", 1e6, (4, 1, 4, False)))
    assert got == pytest.approx(3.0 * alpha + 4.0 * beta)
    assert scaled(BASE, {}) is BASE and scaled(BASE, {"host_cores": 2.0}) is BASE   # no shared host to scale


@pytest.mark.parametrize("compute,alpha,cores", [(1.6, 0.7, 1.5), (0.6, 1.5, 3.0)])
def test_fit_steps_recovers_known_scales(compute, alpha, cores):
    start = BASE.replace(host_cores=2.0)
    truth = scaled(start, {"compute": compute, "comm_alpha": alpha, "host_cores": cores / 2.0})
    texts = TEXTS + ("pp=4,schedule=gpipe", "tp=2,pp=2")
    meas = step_times(truth, texts)
    f = fit_steps([program(t) for t in texts], meas, CL, start, scales=("compute", "comm_alpha", "host_cores"),
                  ridge=1e-4)
    assert np.max(ape(f.table["predicted"], meas)) < 0.01
    assert np.max(ape(f.table["start"], meas)) > 0.2
    assert f.factors["compute"] == pytest.approx(compute, rel=0.05)
    assert f.factors["comm_alpha"] == pytest.approx(alpha, rel=0.05)
    assert f.cost_model.host_cores == pytest.approx(cores, rel=0.1)


def test_fit_steps_leaves_an_exact_model_alone_and_explains_bad_input():
    meas = step_times(BASE)
    f = fit_steps([program(t) for t in TEXTS], meas, CL, BASE)
    assert set(f.factors) == {"compute", "comm_alpha", "comm_beta"}       # no shared host: no host_cores
    assert all(v == pytest.approx(1.0, abs=1e-3) for v in f.factors.values())
    with pytest.raises(CalibrationError, match="one measured time per Program"):
        fit_steps([program("dp=4")], [1.0, 2.0], CL, BASE)
    with pytest.raises(CalibrationError, match="unknown step scales"):
        fit_steps([program("dp=4")], [1.0], CL, BASE, scales=("gpu",))


def test_posted_p2p_is_read_off_the_timelines():
    p = program("pp=4,schedule=gpipe")
    cm = BASE.replace(comm_overhead=1e-3)
    assert posts_p2p([sim.simulate(p, CL, cm.replace(p2p_posted=True)).timeline]) is True
    assert posts_p2p([sim.simulate(p, CL, cm).timeline]) is False
    assert posts_p2p([sim.simulate(program("dp=4"), CL, cm).timeline]) is None
    tl = sim.simulate(p, CL, cm.replace(p2p_posted=True)).timeline
    assert calibrate.fit([tl], CL, programs=[p], p2p_posted=None).cost_model.p2p_posted
    assert not calibrate.fit([tl], CL, programs=[p]).cost_model.p2p_posted          # the default: serial


def test_fit_recovers_per_operation_costs():
    truth = with_op_terms(BASE, ["all_reduce", "all_gather", "reduce_scatter", "send"])
    truth = truth.replace(comm_op_overhead={"all_reduce": 1.2e-3, "all_gather": 4e-4, "reduce_scatter": 2e-4,
                                            "send": 1e-4},
                          comm_op_bw={"all_gather": 2.0, "reduce_scatter": 0.5, "send": 1.0}, p2p_posted=True)
    texts = TEXTS + ("tp=2,dp=2,zero=1",)
    tls = [sim.simulate(program(t), CL, truth).timeline for t in texts]
    f = calibrate.fit(tls, CL, programs=[program(t) for t in texts], per_op=True, p2p_posted=True)
    cm = f.cost_model
    # send ran at one message size only: its fixed cost is fitted, its bandwidth factor is not
    assert "send" in cm.comm_op_overhead and "send" not in cm.comm_op_bw
    # operations seen at several sizes and group sizes: fixed cost and bandwidth factor separate
    for op in ("all_reduce", "all_gather"):
        assert cm.comm_op_overhead[op] == pytest.approx(truth.comm_op_overhead[op], rel=0.05), op
    assert cm.comm_op_bw["all_gather"] == pytest.approx(truth.comm_op_bw["all_gather"], rel=0.05)
    # every operation costs what the truth says at the sizes it ran
    c = f.samples.comm
    for kind, nb, topo, link in set(zip(c["kind"], c["nbytes"], c["topo"], c["link"])):
        op = "send" if kind == "p2p" else kind
        ph = (lambda m: m.p2p_phases(nb, link)) if kind == "p2p" else (lambda m: m.collective_phases(op, nb, topo))
        assert cm.op_time(op, ph(cm)) == pytest.approx(truth.op_time(op, ph(truth)), rel=0.02), (op, nb)
    # operations no sample ran pay the typical fixed cost
    assert cm.comm_overhead == pytest.approx(np.median(list(cm.comm_op_overhead.values())))
    np.testing.assert_allclose(step_times(cm, texts), step_times(truth, texts), rtol=0.02)


def test_refine_fits_step_times_and_reports_factors():
    truth = scaled(BASE.replace(p2p_posted=True), {"compute": 1.5, "comm_alpha": 2.0})
    texts = TEXTS
    # instruction samples say BASE costs, the steps take truth's time: the refinement reconciles them
    tls = [sim.simulate(program(t), CL, BASE.replace(p2p_posted=True)).timeline for t in texts]
    slow = []
    for t, tl in zip(texts, tls):
        k = sim.simulate(program(t), CL, truth).step_time / tl["end"].max()
        slow.append(tl.assign(start=tl["start"] * k, end=tl["end"] * k))   # stretched: idle time grew too
    f = calibrate.fit(slow, CL, programs=[program(t) for t in texts], means=False, refine=True, p2p_posted=True)
    assert set(f.step_factors) == {"compute", "comm_alpha", "comm_beta"}
    assert np.median(ape(f.steps["predicted"], f.steps["measured"])) < 0.05
    off = calibrate.fit(slow, CL, programs=[program(t) for t in texts], means=False, p2p_posted=True)
    assert off.step_factors == {}
    assert np.median(ape(off.steps["predicted"], off.steps["measured"])) > np.median(
        ape(f.steps["predicted"], f.steps["measured"]))
    with pytest.raises(CalibrationError, match="host_cores"):
        calibrate.fit(slow, CL, programs=[program(t) for t in texts], host_cores=0)
    # with a shared host the refinement fits its core count too
    h = calibrate.fit(slow, CL, programs=[program(t) for t in texts], means=False, refine=True, p2p_posted=True,
                      host_cores=3.0)
    assert "host_cores" in h.step_factors and h.cost_model.host_cores == pytest.approx(3.0 * h.step_factors["host_cores"])


def test_dispatch_overhead_is_fitted_when_asked():
    # compute that pays a per-region dispatch cost on top of the math: mbs=2 ops cost less than twice mbs=1 ones
    truth = BASE.replace(region_overhead={"layer": 4e-4, "attn": 2e-4, "mlp": 2e-4, "embed": 1e-4, "head": 1e-4},
                         phase_overhead={"fwd": 1.0, "bwd": 2.0}, region_floor={k: 1e-6 for k in BASE.region_floor},
                         efficiency={k: v * 0.3 for k, v in BASE.efficiency.items()})
    texts = ("dp=4", "tp=2,dp=2", "pp=4", "pp=4,mbs=2")
    tls = [sim.simulate(program(t), CL, truth).timeline for t in texts]
    kw = dict(programs=[program(t) for t in texts], refine=False, means=False)
    f = calibrate.fit(tls, CL, dispatch=True, **kw)
    plain = calibrate.fit(tls, CL, **kw)
    assert f.cost_model.region_overhead and not plain.cost_model.region_overhead
    tc, _ = calibrate.predict_samples(f.samples, truth)
    pc, _ = calibrate.predict_samples(f.samples, f.cost_model)
    qc, _ = calibrate.predict_samples(plain.samples, plain.cost_model)
    assert np.median(ape(pc, tc)) < 0.02 and np.max(ape(pc, tc)) < np.max(ape(qc, tc))
    # an unseen microbatch size is then predicted from the dispatch/math split
    other = program("dp=2,pp=2,mbs=2")
    t = sim.simulate(other, CL, truth).step_time
    assert sim.simulate(other, CL, f.cost_model).step_time == pytest.approx(t, rel=0.03)
