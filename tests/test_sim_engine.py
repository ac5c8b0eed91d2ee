"""The simulator against closed-form results on hand-built Programs."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_programs import pipeline, unit_cost

from parashift import cluster as clusters
from parashift.errors import DeadlockError, DeviceListError, ProgramError
from parashift.ir.program import Instr, Program, RankProgram
from parashift.sim import TIMELINE_COLUMNS, simulate, simulate_switch
from parashift.strategy import Strategy


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_1f1b_step_time_and_bubble_are_exact(pp, k):
    m = k * pp
    tf, tb = 1.0, 2.0
    res = simulate(pipeline(pp, m, "1f1b", tf=tf, tb=tb), "a100-1x8", unit_cost())
    assert res.step_time == (m + pp - 1) * (tf + tb)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)


def test_nonuniform_costs_and_transfer_time_add_up():
    # 2 stages, 1 micro-batch: F0 | send | F1 B1 | send | B0, each transfer costs its bytes.
    res = simulate(pipeline(2, 1, tf=1.0, tb=3.0, p2p_bytes=5), "a100-1x8", unit_cost())
    assert res.step_time == 1 + 5 + 1 + 3 + 5 + 3


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12)])
def test_gpipe_stashes_m_activations_and_1f1b_pp_on_stage_0(pp, m):
    a = 1000
    gp = simulate(pipeline(pp, m, "gpipe", act=a), "a100-1x8", unit_cost())
    ob = simulate(pipeline(pp, m, "1f1b", act=a), "a100-1x8", unit_cost())
    assert gp.peak_memory[0] == m * a
    assert ob.peak_memory[0] == pp * a
    assert ob.peak_memory[pp - 1] == a  # the last stage runs F,B alternately
    assert all(ob.peak_memory[s] == (pp - s) * a for s in range(pp))


def test_event_log_of_two_stage_pipeline():
    res = simulate(pipeline(2, 2, tf=1.0, tb=2.0), "a100-1x8", unit_cost())
    # (start, device, stream, instruction id): recvs post at 0 and wait; stage 1 starts F0 at 1.
    assert res.event_log() == [
        (0.0, 0, "compute", 2), (0.0, 0, "p2p.b0", 0), (0.0, 0, "p2p.b1", 1), (0.0, 1, "p2p.f0", 0),
        (0.0, 1, "p2p.f1", 1), (1.0, 0, "compute", 4), (1.0, 0, "p2p.f0", 3), (1.0, 1, "compute", 2),
        (2.0, 0, "p2p.f1", 5), (2.0, 1, "compute", 3), (4.0, 0, "compute", 6), (4.0, 1, "compute", 5),
        (4.0, 1, "p2p.b0", 4), (5.0, 1, "compute", 6), (7.0, 0, "compute", 7), (7.0, 1, "p2p.b1", 7)]
    ends = {(d, i): e for d, i, e in zip(res.timeline["device"], res.timeline["id"], res.timeline["end"])}
    assert ends[(0, 7)] == 9.0 and ends[(1, 6)] == 7.0


def test_event_log_with_collectives_and_contention():
    # rank 0 and 1: compute (2), then a TP all-reduce of 4 bytes (ring of 2: 2*(1/2)*4 = 4 s);
    # meanwhile each also sends 2 bytes to the other on stream "x": the out-links are shared.
    def prog(peer):
        return RankProgram({
            "compute": (Instr(0, "compute", flops=2.0, phase="fwd"),
                        Instr(1, "all_reduce", group=(0, 1), nbytes=4, tag="ar")),
            "x": (Instr(2, "send", "x", peer=peer, nbytes=2, tag=f"s{1 - peer}"),),
            "y": (Instr(3, "recv", "y", peer=peer, nbytes=2, tag=f"s{peer}"),)})
    p = Program({0: prog(1), 1: prog(0)})
    res = simulate(p, "a100-1x8", unit_cost(algorithm="ring"))
    # sends run alone on [0, 2), then the all-reduce alone on [2, 6).
    log = [(s, d, st, i) for s, d, st, i in res.event_log()]
    assert log == [(0.0, 0, "compute", 0), (0.0, 0, "x", 2), (0.0, 0, "y", 3), (0.0, 1, "compute", 0),
                   (0.0, 1, "x", 2), (0.0, 1, "y", 3), (2.0, 0, "compute", 1), (2.0, 1, "compute", 1)]
    assert res.step_time == 6.0
    # now start the sends at the same time as the all-reduce: both flows share each out-link.
    def prog2(peer):
        return RankProgram({
            "compute": (Instr(0, "compute", flops=2.0, phase="fwd"),
                        Instr(1, "all_reduce", group=(0, 1), nbytes=4, tag="ar")),
            "x": (Instr(2, "send", "x", deps=(0,), peer=peer, nbytes=2, tag=f"s{1 - peer}"),),
            "y": (Instr(3, "recv", "y", peer=peer, nbytes=2, tag=f"s{peer}"),)})
    res2 = simulate(Program({0: prog2(1), 1: prog2(0)}), "a100-1x8", unit_cost(algorithm="ring"))
    tl = res2.timeline.set_index(["device", "id"])
    # two flows at half rate until the 2-byte send finishes at 2 + 4 = 6, then the all-reduce
    # has 2 of its 4 bytes left at full rate: 6 + 2 = 8.
    assert tl.loc[(0, 2), "end"] == 6.0
    assert tl.loc[(0, 1), "end"] == 8.0


def test_compute_streams_share_the_device():
    rp = RankProgram({"compute": (Instr(0, "compute", flops=3.0, phase="fwd"),),
                      "compute2": (Instr(1, "compute", "compute2", flops=1.0, phase="fwd"),)})
    res = simulate(Program({0: rp}), "a100-1x8", unit_cost())
    tl = res.timeline.set_index("id")
    assert tl.loc[1, "end"] == 2.0   # half rate while both run
    assert tl.loc[0, "end"] == 4.0   # 1 unit done by t=2, then 2 more at full rate


@pytest.mark.parametrize("n,per_node", [(2, 8), (4, 8), (8, 8)])
def test_ring_all_reduce_formula(n, per_node):
    b, a, bw = 2**20, 5e-6, 1e11
    cm = unit_cost(algorithm="ring", latency=dict(local=0.0, intra=a, inter=a),
                   bandwidth=dict(local=bw, intra=bw, inter=bw), comm_overhead=0.0)
    rp = RankProgram({"comm": (Instr(0, "all_reduce", "comm", group=tuple(range(n)), nbytes=b, tag="g"),)})
    res = simulate(Program({r: rp for r in range(n)}), f"a100-1x{per_node}", cm)
    assert res.step_time == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * b / bw, rel=1e-12)


def test_hierarchical_all_reduce_across_nodes_and_auto_choice():
    b, n, k = 2**26, 16, 8
    cm = unit_cost(algorithm="hierarchical", latency=dict(local=0.0, intra=1e-6, inter=1e-5),
                   bandwidth=dict(local=1e12, intra=2e11, inter=2e10))
    rp = RankProgram({"comm": (Instr(0, "all_reduce", "comm", group=tuple(range(n)), nbytes=b, tag="g"),)})
    prog = Program({r: rp for r in range(n)})
    res = simulate(prog, "a100-2x8", cm)
    intra = 2 * ((k - 1) * 1e-6 + (k - 1) / k * b / 2e11)           # reduce-scatter + all-gather in node
    inter = min(2 * 1e-5 + b / k / 2e10,                              # ring of 2 nodes on b/k
                2 * 1e-5 + 2 * (b / k) / 2e10)                        # tree of 2 nodes
    assert res.step_time == pytest.approx(intra + inter, rel=1e-12)
    flat = simulate(prog, "a100-2x8", cm.replace(algorithm="ring")).step_time
    auto = simulate(prog, "a100-2x8", cm.replace(algorithm="auto")).step_time
    assert auto == pytest.approx(min(flat, res.step_time), rel=1e-12) and res.step_time < flat


def test_folding_equals_unfolded_simulation():
    c = clusters.get("a100-2x4")  # dp groups span both nodes
    cm = unit_cost(latency=dict(local=0.0, intra=0.25, inter=0.5), bandwidth=dict(local=1.0, intra=4.0, inter=1.0))
    prog = pipeline(2, 4, tf=1.0, tb=2.0, act=10, p2p_bytes=3, dp=2, tp=2, tp_bytes=2, dp_bytes=8, static=5)
    folded = simulate(prog, c, cm)
    assert len(folded.raw.folding.members) == 2
    full = simulate(prog, c, cm, fold=False)
    assert len(full.raw.folding.members) == 8
    cols = list(TIMELINE_COLUMNS)
    key = ["rank", "stream", "id"]
    a = folded.timeline.sort_values(key).reset_index(drop=True)[cols]
    b = full.timeline.sort_values(key).reset_index(drop=True)[cols]
    assert a.equals(b)
    assert folded.peak_memory == full.peak_memory
    assert folded.link_bytes == pytest.approx(full.link_bytes)
    assert folded.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-12)
    # unshared RankProgram objects are never folded together
    assert len(simulate(pipeline(2, 4, dp=2, tp=2, share=False), c, cm).raw.folding.members) == 8


def test_folding_splits_ranks_with_different_topology():
    # placement puts one DP replica of stage 0 on another node: its group differs, so it is not folded
    prog = pipeline(2, 2, dp=2, dp_bytes=4)
    res = simulate(prog, "a100-2x4", unit_cost(), devices={0: 0, 1: 1, 2: 2, 3: 4})
    full = simulate(prog, "a100-2x4", unit_cost(), devices={0: 0, 1: 1, 2: 2, 3: 4}, fold=False)
    key = ["rank", "stream", "id"]
    assert res.timeline.sort_values(key).reset_index(drop=True).equals(
        full.timeline.sort_values(key).reset_index(drop=True))
    assert set(res.peak_memory) == {0, 1, 2, 4}


def test_deadlock_is_reported_with_ranks_and_instructions():
    def rp(peer):
        return RankProgram({"p2p": (Instr(0, "recv", "p2p", peer=peer, nbytes=1, tag=f"t{peer}"),
                                    Instr(1, "send", "p2p", peer=peer, nbytes=1, tag=f"t{1 - peer}"))})
    with pytest.raises(DeadlockError, match=r"rank 0 stream p2p at \[0 recv"):
        simulate(Program({0: rp(1), 1: rp(0)}), "a100-1x8", unit_cost())


def test_bad_inputs_raise_clear_errors():
    prog = pipeline(2, 2)
    with pytest.raises(DeviceListError, match="one device per rank"):
        simulate(prog, "a100-1x8", devices=[0])
    with pytest.raises(DeviceListError, match="not in a100-1x8"):
        simulate(prog, "a100-1x8", devices={0: 0, 1: 9})
    bad = RankProgram({"compute": (Instr(0, "compute", flops=1.0, phase="fwd", free=("x",)),)})
    with pytest.raises(ProgramError, match="frees buffer 'x'"):
        simulate(Program({0: bad}), "a100-1x8", unit_cost())
    with pytest.raises(ProgramError, match="needs a parashift Program"):
        simulate("nope", "a100-1x8")  # type: ignore[arg-type]


def test_memory_fits_and_breakdown():
    cm = unit_cost(memory_capacity=100, memory_reserved=10)
    res = simulate(pipeline(2, 4, act=20, static=5), "a100-1x8", cm)
    assert res.peak_memory == {0: 45, 1: 25}
    assert res.fits
    mem = res.memory_frame()
    assert list(mem["peak"]) == [45, 25] and list(mem["activations"]) == [40, 20]
    assert res.memory_summary()["dominant"] == "activations"
    # stage 1 (last) of 1f1b: each F allocs 20 at its start, its B frees them at its end
    mt = res.memory_timeline([1])
    assert list(mt["bytes"]) == [5] + [25, 5] * 4
    assert list(mt["time"]) == [0.0, 1.0, 4.0, 4.0, 7.0, 7.0, 10.0, 10.0, 13.0]
    assert mt["bytes"].max() == res.peak_memory[1]
    over = simulate(pipeline(2, 4, act=50, static=5), "a100-1x8", cm)
    assert not over.fits and over.peak_memory_max == 105
    states = simulate(pipeline(2, 4, act=1, static=60), "a100-1x8", cm)
    assert states.memory_summary()["dominant"] == "states"


def test_throughput_mfu_and_outputs(tmp_path):
    prog = pipeline(2, 4, tf=1.0, tb=2.0)
    res = simulate(prog, "a100-1x8", unit_cost())
    assert res.step_time == 15.0
    assert res.tokens_per_s == pytest.approx(4 / 15.0)
    # 2 ranks each doing 4*(1+2) model FLOPs in 15 s against the cluster's peak
    assert res.mfu == pytest.approx(24 / (15.0 * 2 * 312e12))
    assert list(res.timeline.columns) == list(TIMELINE_COLUMNS)
    res.to_chrome_trace(str(tmp_path / "t.json"))
    trace = json.load(open(tmp_path / "t.json"))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.timeline) and {e["pid"] for e in xs} == {0, 1}
    res.plot_timeline(str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000
    s = res.summary()
    assert set(s) >= {"step_time", "tokens_per_s", "mfu", "bubble_fraction", "peak_memory", "peak_memory_max",
                      "fits", "sim_seconds"}


def test_simulate_switch_counts_bytes_per_link_class():
    # devices 0,1 on node 0 and 8 on node 1: 0 -> 1 intra (6 B), 0 -> 8 inter (10 B), 8 copies 4 B locally.
    r0 = RankProgram({"p2p": (Instr(0, "send", "p2p", peer=1, nbytes=6, tag="a"),
                              Instr(1, "send", "p2p", peer=8, nbytes=10, tag="b"))}, {"param": 7})
    r1 = RankProgram({"p2p": (Instr(0, "recv", "p2p", peer=0, nbytes=6, tag="a", alloc=(("in", 6),)),)})
    r8 = RankProgram({"p2p": (Instr(0, "recv", "p2p", peer=0, nbytes=10, tag="b"),),
                      "local": (Instr(1, "copy", "local", nbytes=4),)})
    cm = unit_cost(bandwidth=dict(local=4.0, intra=2.0, inter=1.0))
    sw = simulate_switch(Program({0: r0, 1: r1, 8: r8}), "a100-2x8", cm)
    assert sw.link_bytes == {"local": 4.0, "intra": 6.0, "inter": 10.0}
    assert sw.switch_time == 3.0 + 10.0   # sends run in order on rank 0's p2p stream
    assert sw.peak_memory == {0: 7, 1: 6, 8: 0}
    assert sw.summary()["bytes_inter"] == 10.0


def test_all_to_all_on_comm_stream_overlaps_the_other_microbatch():
    """DualPipe-style overlap: while micro-batch 0's dispatch all-to-all runs on "comm", the compute
    stream runs micro-batch 1's router; the experts wait only for their own dispatch."""
    def rp():
        return RankProgram({
            "compute": (Instr(0, "compute", phase="fwd", microbatch=0, flops=1.0),          # route m0
                        Instr(1, "compute", phase="fwd", microbatch=1, flops=3.0),          # route m1
                        Instr(2, "compute", "compute", (3,), phase="fwd", microbatch=0, flops=1.0),  # experts m0
                        Instr(4, "compute", "compute", (5,), phase="fwd", microbatch=1, flops=1.0)),  # experts m1
            "comm": (Instr(3, "all_to_all", "comm", (0,), group="ep", nbytes=4, tag="d0", microbatch=0),
                     Instr(5, "all_to_all", "comm", (1,), group="ep", nbytes=4, tag="d1", microbatch=1))})
    prog = Program({0: rp(), 1: rp()}, Strategy(dp=2, ep=2), {})
    res = simulate(prog, "a100-1x8", unit_cost(algorithm="ring"))
    # all-to-all of 4 B over 2 ranks: each sends 2 B at 1 B/s = 2 s
    assert res.event_log([0]) == [(0.0, 0, "compute", 0), (1.0, 0, "comm", 3), (1.0, 0, "compute", 1),
                                  (4.0, 0, "comm", 5), (4.0, 0, "compute", 2), (6.0, 0, "compute", 4)]
    tl = res.timeline_of([0]).set_index("id")
    # m0's dispatch [1, 3) runs entirely under m1's router [1, 4)
    assert (tl.loc[3, "start"], tl.loc[3, "end"]) == (1.0, 3.0) and (tl.loc[1, "start"], tl.loc[1, "end"]) == (1.0, 4.0)
    assert res.step_time == 7.0


@settings(max_examples=15, deadline=None)
@given(pp=st.integers(1, 4), k=st.integers(1, 2), tf=st.integers(1, 4), tb=st.integers(1, 8),
       dp=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2]), p2p=st.integers(0, 3), sched=st.sampled_from(["1f1b", "gpipe"]))
def test_random_pipelines_fold_exactly_and_match_the_formula(pp, k, tf, tb, dp, tp, p2p, sched):
    m = k * pp
    prog = pipeline(pp, m, sched, tf=float(tf), tb=float(tb), act=3, p2p_bytes=p2p, dp=dp, tp=tp, tp_bytes=2,
                    dp_bytes=4)
    cm = unit_cost(bandwidth=dict(local=1.0, intra=2.0, inter=1.0), latency=dict(local=0.0, intra=0.5, inter=1.0))
    folded = simulate(prog, "a100-4x4", cm)
    full = simulate(prog, "a100-4x4", cm, fold=False)
    key = ["rank", "stream", "id"]
    assert folded.timeline.sort_values(key).reset_index(drop=True).equals(
        full.timeline.sort_values(key).reset_index(drop=True))
    assert folded.peak_memory == full.peak_memory
    if tp == 1 and dp == 1 and p2p == 0:
        assert simulate(prog, "a100-4x4", unit_cost()).step_time == (m + pp - 1) * (tf + tb)
