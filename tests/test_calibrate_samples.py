"""Calibration samples: what each instruction cost, with peers' waiting and clock skew removed."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import calibrate, cluster as clusters, ir, models, sim
from parashift.calibrate.probe import probe_strategies
from parashift.calibrate.samples import align_clocks
from parashift.cost import topology
from parashift.strategy import Strategy

CL = clusters.get("cpu-local")
SPEC = models.get("tiny-gpt")


def run(text: str, cm: sim.CostModel | None = None):
    p = ir.compile(SPEC, Strategy.parse(text).validate(SPEC), global_batch=8, seq_len=32)
    return sim.simulate(p, CL, cm or sim.CostModel.for_cluster(CL)).timeline, p


def test_samples_are_the_cost_models_uncontended_times():
    cm = sim.CostModel.for_cluster(CL)
    tl, p = run("tp=2,dp=2")
    s = calibrate.extract([tl], CL, [p])
    assert len(s.compute) == int((tl["op"] == "compute").sum())
    # collectives: one sample per instance (not per member), costing exactly comm_time
    n_inst = tl[tl["op"] != "compute"].groupby(["rank"]).size().iloc[0] * 2   # 2 groups of each axis
    assert len(s.comm) == n_inst
    ar = s.comm[(s.comm["op"] == "all_reduce") & (s.comm["nbytes"] == 16384)]
    expect = cm.comm_time(cm.collective_phases("all_reduce", 16384, topology(CL, [0, 1])))
    np.testing.assert_allclose(ar["measured"], expect, rtol=1e-9)
    # compute: the cost model's compute_time (the rank's stream predecessor or deps end first)
    fwd = s.compute[(s.compute["phase"] == "fwd") & (s.compute["region"] == "layers.0.attn")]
    ins = next(i for i in p.ranks[0].instrs() if i.phase == "fwd" and i.region == "layers.0.attn")
    np.testing.assert_allclose(fwd["measured"], cm.compute_time(ins), rtol=1e-9)
    assert s.steps["measured"].iloc[0] == pytest.approx(tl["end"].max() - tl["start"].min())


def test_pipeline_sends_pair_with_their_recvs():
    tl, p = run("pp=4,schedule=gpipe")
    s = calibrate.extract([tl], CL, [p])
    sends = int((tl["op"] == "send").sum())
    assert len(s.comm) == sends and set(s.comm["kind"]) == {"p2p"} and set(s.comm["link"]) == {"intra"}
    assert s.dropped["unmatched_p2p"] == 0
    cut = tl[~((tl["op"] == "recv") & (tl["rank"] == 1))]
    s2 = calibrate.extract([cut], CL, [p])
    assert s2.dropped["unmatched_p2p"] == int(((tl["op"] == "recv") & (tl["rank"] == 1)).sum())


def test_incomplete_collectives_are_dropped():
    tl, p = run("dp=4")
    cut = tl[~((tl["op"] == "all_reduce") & (tl["rank"] == 3))]
    s = calibrate.extract([cut], CL, [p])
    assert len(s.comm) == 0 and s.dropped["incomplete_collective"] > 0


@pytest.mark.parametrize("text,offsets", [("tp=2,dp=2", {1: 2e-3, 3: -1e-3}),
                                          ("pp=4,schedule=gpipe", {1: 3e-3, 2: -2e-3, 3: 1e-3}),
                                          ("tp=2,pp=2", {2: 4e-3, 3: 4e-3})])
def test_clock_skew_between_ranks_is_removed(text, offsets):
    tl, p = run(text)
    shift = tl["rank"].map(offsets).fillna(0.0)
    skewed = tl.assign(start=tl["start"] + shift, end=tl["end"] + shift)
    # measured from the last arrival to the first completion: the offsets matter
    clean = calibrate.extract([tl], CL, [p], align=False, jitter=False)
    raw = calibrate.extract([skewed], CL, [p], align=False, jitter=False)
    fixed = calibrate.extract([skewed], CL, [p], jitter=False)
    assert len(raw.comm) != len(clean.comm) or not np.allclose(raw.comm["measured"], clean.comm["measured"])
    np.testing.assert_allclose(np.sort(fixed.comm["measured"]), np.sort(clean.comm["measured"]), atol=1e-9)
    # compute samples never compare clocks of different ranks
    np.testing.assert_allclose(raw.compute["measured"], clean.compute["measured"], atol=1e-12)
    # nor do collectives of peers running one program, charged what each member saw (jitter)
    peers = calibrate.extract([skewed], CL, [p])
    sym = peers.comm["kind"] != "p2p"
    np.testing.assert_allclose(np.sort(peers.comm["measured"][sym]),
                               np.sort(clean.comm["measured"][clean.comm["kind"] != "p2p"]), atol=1e-9)


def test_lockstep_peers_are_charged_the_wait_for_the_straggler():
    tl, p = run("dp=4")
    clean = calibrate.extract([tl], CL, [p], jitter=False).comm["measured"].to_numpy()
    late = 0.4 * clean.min()
    is_late = (tl["rank"] == 3) & (tl["op"] == "all_reduce")
    slow = tl.assign(start=tl["start"].where(~is_late, tl["start"] + late))   # rank 3 arrives late
    strict = calibrate.extract([slow], CL, [p], jitter=False).comm["measured"]
    seen = calibrate.extract([slow], CL, [p]).comm["measured"]
    np.testing.assert_allclose(strict, clean - late, atol=1e-12)                 # from the last arrival
    np.testing.assert_allclose(seen, clean - late / 4, atol=1e-12)               # what members saw, on average


def test_align_clocks_leaves_an_aligned_timeline_alone():
    tl, p = run("tp=2,dp=2")
    joined = calibrate.extract([tl], CL, [p])  # exercise the join once
    assert len(joined.comm)
    info = tl.assign(tag=None, who=[()] * len(tl))
    out = align_clocks(info.assign(step=0))
    np.testing.assert_array_equal(out["start"], tl["start"])


def test_probe_strategies_are_diverse_and_valid():
    got = probe_strategies("tiny-gpt", 4)
    assert len(got) >= 6 and all(s.world == 4 for s in got)
    assert len({str(s) for s in got}) == len(got)
    assert any(s.tp > 1 for s in got) and any(s.pp > 1 for s in got) and any(s.zero for s in got)
    assert [str(s) for s in probe_strategies("tiny-gpt", 4, 3)] == [str(s) for s in got[:3]]
    assert all(s.world == 2 for s in probe_strategies("tiny-gpt", 2))
    with pytest.raises(calibrate.CalibrationError, match="no probe strategy"):
        probe_strategies("tiny-gpt", 5)
