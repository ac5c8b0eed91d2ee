"""The cost-model terms calibration fits on CPU hosts: shared host cores, posted send/recv,
per-operation communication costs and dispatch overheads. Defaults leave every figure unchanged."""
from __future__ import annotations

import functools

import pytest

from parashift import cluster as clusters, ir, models, sim
from parashift.ir.program import Instr, Program, RankProgram
from parashift.cost import CostModelError

CL = clusters.get("cpu-local")
BASE = sim.CostModel.for_cluster(CL)
SPEC = models.get("tiny-gpt")


@functools.lru_cache(maxsize=None)
def program(text: str):
    from parashift.strategy import Strategy
    return ir.compile(SPEC, Strategy.parse(text).validate(SPEC), global_batch=8, seq_len=32)


def _compute_only(n: int, seconds: float) -> Program:
    """``n`` ranks each running one compute instruction of ``seconds`` under BASE."""
    flops = seconds * BASE.peak_flops * BASE.efficiency["fwd"] * BASE.region_efficiency["mlp"]
    ranks = {r: RankProgram({"compute": (Instr(0, "compute", phase="fwd", region="layers.0.mlp", flops=flops),)})
             for r in range(n)}
    return Program(ranks)


@pytest.mark.parametrize("cores,n", [(2.0, 4), (3.0, 4), (1.0, 2), (8.0, 4)])
def test_concurrent_compute_shares_the_host_cores(cores, n):
    t = BASE.compute_time(_compute_only(1, 1e-3).ranks[0].streams["compute"][0])
    alone = sim.simulate(_compute_only(n, 1e-3), CL, BASE).step_time
    shared = sim.simulate(_compute_only(n, 1e-3), CL, BASE.replace(host_cores=cores)).step_time
    assert alone == pytest.approx(t)
    assert shared == pytest.approx(t / min(1.0, cores / n), rel=1e-9)


def test_host_sharing_only_slows_overlapping_compute():
    # a pipeline's stages compute at different times: less slowdown than lockstep data parallelism
    cm = BASE.replace(host_cores=2.0)
    slow = {t: sim.simulate(program(t), CL, cm).step_time / sim.simulate(program(t), CL, BASE).step_time
            for t in ("dp=4", "pp=4,schedule=gpipe")}
    assert slow["dp=4"] > slow["pp=4,schedule=gpipe"] > 1.0


def test_posted_sends_and_recvs_let_the_stream_go_on():
    p = program("pp=4,schedule=gpipe")
    serial = sim.simulate(p, CL, BASE.replace(comm_overhead=1e-3))
    posted = sim.simulate(p, CL, BASE.replace(comm_overhead=1e-3, p2p_posted=True))
    assert posted.step_time < serial.step_time
    # every instruction still runs once, and a recv never ends before its data could arrive
    assert len(posted.timeline) == len(serial.timeline)
    tl = posted.timeline
    recv = tl[tl["op"] == "recv"]
    assert (recv["end"] - recv["start"] >= 1e-3 - 1e-12).all()


def test_per_operation_costs_replace_the_shared_ones():
    cm = BASE.replace(comm_op_overhead={"all_reduce": 5e-4}, comm_op_bw={"reduce_scatter": 0.5})
    ph = cm.collective_phases("reduce_scatter", 1e6, (4, 1, 4, False))
    assert cm.op_time("reduce_scatter", ph) == pytest.approx(
        cm.comm_overhead + sum(p.latency + 2 * p.nbytes / cm.link_bw(p.link) for p in ph))
    ar = cm.collective_phases("all_reduce", 1e6, (4, 1, 4, False))
    assert cm.op_time("all_reduce", ar) == pytest.approx(5e-4 + sum(cm.phase_time(p) for p in ar))
    assert cm.op_overhead("send") == cm.comm_overhead + cm.p2p_overhead
    # the simulator charges the same
    p = program("dp=4")
    t0 = sim.simulate(p, CL, BASE).step_time
    t1 = sim.simulate(p, CL, BASE.replace(comm_op_overhead={"all_reduce": BASE.comm_overhead + 0.01})).step_time
    assert t1 - t0 == pytest.approx(0.01, rel=1e-6)


def test_dispatch_overhead_adds_to_the_math():
    ins = Instr(0, "compute", phase="bwd", region="layers.0-1", flops=1e9)
    cm = BASE.replace(region_overhead={"layer": 1e-4}, phase_overhead={"bwd": 3.0})
    assert cm.compute_time(ins) == pytest.approx(BASE.compute_time(ins) + 2 * 1e-4 * 3.0)


def test_defaults_change_nothing_and_round_trip(tmp_path):
    cm = BASE.replace(host_cores=2.5, p2p_posted=True, comm_op_overhead={"send": 1e-4}, comm_op_bw={"all_gather": 2.0},
                      region_overhead={"attn": 1e-5}, phase_overhead={"fwd": 1.5}, switch_overhead=2e-3)
    cm.save(str(tmp_path / "c.json"))
    assert sim.CostModel.load(str(tmp_path / "c.json")) == cm
    old = BASE.to_json()
    for k in ("host_cores", "p2p_posted", "comm_op_overhead", "comm_op_bw", "region_overhead", "phase_overhead",
              "switch_overhead"):
        old.pop(k)
    assert sim.CostModel.from_json(old) == BASE      # files written before these fields still load
    a800 = clusters.get("a800-2x8")
    p = ir.compile(SPEC, program("tp=2,pp=2").strategy, global_batch=8, seq_len=32)
    assert sim.simulate(p, a800).step_time == sim.simulate(p, a800, sim.CostModel.for_cluster(a800)).step_time
    with pytest.raises(CostModelError, match="host_cores"):
        BASE.replace(host_cores=-1.0)
    with pytest.raises(CostModelError, match="comm_op_bw"):
        BASE.replace(comm_op_bw={"send": 0.0})
    with pytest.raises(CostModelError, match="switch_overhead"):
        BASE.replace(switch_overhead=-1e-3)
