"""Communication as Megatron does it: pipeline sends under TP scatter/gather, NICs per node."""
from __future__ import annotations

import pytest

from parashift import cluster as clusters, models
from parashift.cost import CostModel
from parashift.ir import compile as ir_compile
from parashift.sim import simulate
from parashift.strategy import Strategy

MODEL = models.get("gpt:layers=4,hidden=2048,heads=16,seq_len=1024")


def _run(strategy: str, cluster: str, **cost):
    cl = clusters.get(cluster)
    prog = ir_compile(MODEL, Strategy.parse(strategy), global_batch=16, seq_len=1024)
    return simulate(prog, cl, CostModel.for_cluster(cl).replace(**cost), model=MODEL)


def test_pipeline_sends_under_tp_move_one_tp_th_across_nodes():
    sg = _run("tp=8,pp=2,mbs=1", "a100-2x8")
    full = _run("tp=8,pp=2,mbs=1", "a100-2x8", pp_scatter_gather=False)
    # only pipeline sends cross nodes here (stage = node): 1/8 of the bytes, plus an all-gather on NVLink
    assert sg.link_bytes["inter"] == pytest.approx(full.link_bytes["inter"] / 8)
    assert sg.link_bytes["intra"] > full.link_bytes["intra"]
    assert sg.step_time < full.step_time
    # no TP: nothing to scatter
    a = _run("dp=8,pp=2,mbs=1", "a100-2x8")
    b = _run("dp=8,pp=2,mbs=1", "a100-2x8", pp_scatter_gather=False)
    assert a.link_bytes == b.link_bytes and a.step_time == b.step_time


def test_fewer_nics_per_node_slow_inter_node_collectives():
    eight = _run("dp=16,mbs=1", "a100-2x8")
    two = _run("dp=16,mbs=1", "a100-2x8:nics_per_node=2")
    assert two.step_time > eight.step_time
    assert two.link_bytes == eight.link_bytes                       # same traffic, less bandwidth


def test_a_pipeline_send_and_another_send_of_the_same_size_get_their_own_phases():
    """The phase cache keys on whether a send is scattered over TP, not on its size and link alone."""
    from parashift.ir.program import Instr
    from parashift.sim.engine import Engine
    cl = clusters.get("a100-2x8")
    prog = ir_compile(MODEL, Strategy.parse("tp=8,pp=2,mbs=1"), global_batch=16, seq_len=1024)
    eng = Engine(prog, cl, CostModel.for_cluster(cl))
    eng.run()
    other = Instr.make(id=0, op="send", nbytes=1 << 20, peer="cp1")
    pipe = Instr.make(id=1, op="send", nbytes=1 << 20, peer="pp1")
    plain = eng._p2p_phases(other, "inter")
    scattered = eng._p2p_phases(pipe, "inter")
    assert sum(p.nbytes for p in plain if p.link == "inter") == 1 << 20
    assert sum(p.nbytes for p in scattered if p.link == "inter") == (1 << 20) / 8
