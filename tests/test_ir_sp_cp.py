"""Sequence and context parallelism in the IR: the communication each adds (ops, groups, bytes),
valid programs under every schedule, the simulator's time and memory, and switch plans."""
from __future__ import annotations

from collections import Counter

import pytest

from parashift import Strategy, models, vps
from parashift.ir import compile
from parashift.ir.tags import parse_tag
from parashift.sim import simulate

SPEC = models.get("tiny-gpt")
SEQ, GB = 32, 8


def _comm(prog, rank=0):
    return Counter((i.op, i.key, i.group if isinstance(i.group, str) else None, i.nbytes)
                   for i in prog.ranks[rank].instrs() if i.op != "compute")


def test_sequence_parallel_replaces_all_reduces():
    """Per block: fwd reduce-scatter + all-gather (instead of one all-reduce), bwd the same plus the
    re-gather of the saved sequence-sharded input; all over tp with the full activation's bytes."""
    s = Strategy.parse("dp=2,tp=2,sp")
    m = s.num_microbatches(GB)
    act = s.mbs * SEQ * SPEC.hidden * SPEC.dtype_bytes
    c = _comm(compile(SPEC, s, global_batch=GB, seq_len=SEQ, validate=True))
    blocks = 2 * SPEC.layers
    assert c[("reduce_scatter", "sp_scatter", "tp", act)] == m * (blocks + 1 + blocks + 1)  # fwd: embed+blocks; bwd: blocks+head
    assert c[("all_gather", "sp_gather", "tp", act)] == m * (2 * blocks + 2)
    assert c[("all_gather", "sp_input", "tp", act)] == m * (blocks + 1)
    assert not any(op == "all_reduce" and g == "tp" for op, _, g, _ in c)
    plain = _comm(compile(SPEC, "dp=2,tp=2", global_batch=GB, seq_len=SEQ))
    assert sum(n for (op, _, g, _), n in plain.items() if op == "all_reduce" and g == "tp") == m * (2 * blocks + 2)


def test_context_parallel_gathers_kv_and_reduces_over_dp_x_cp():
    s = Strategy.parse("dp=2,cp=2,zero=1")
    m = s.num_microbatches(GB)
    prog = compile(SPEC, s, global_batch=GB, seq_len=SEQ, validate=True)
    kv = 2 * (SEQ // 2) * SPEC.kv_heads * SPEC.head_dim * SPEC.dtype_bytes   # one rank's K and V
    c = _comm(prog)
    assert c[("all_gather", "cp_kv", "cp", 2 * kv)] == m * 2 * SPEC.layers    # fwd and bwd
    assert c[("reduce_scatter", "cp_dkv", "cp", 2 * kv)] == m * SPEC.layers
    assert {g for (_, k, g, _) in c if k and k.startswith(("grad:", "param:"))} == {"dpcp"}
    assert prog.resolve_group(0, next(i for i in prog.ranks[0].instrs() if i.key == "cp_kv")) == (0, 1)
    assert s.group(0, "dpcp") == (0, 1, 2, 3)
    # every rank's compute is a cp-th of one process's
    one = compile(SPEC, "dp=2", global_batch=GB, seq_len=SEQ)
    flops = lambda p: sum(i.flops for i in p.ranks[0].instrs() if i.op == "compute" and i.phase != "optim")
    assert flops(prog) == pytest.approx(flops(one) / 2)


@pytest.mark.parametrize("strategy", [
    "tp=2,sp,pp=2", "tp=2,sp,cp=2,pp=2,vpp=2", "cp=2,pp=2,schedule=zb-h1", "tp=2,sp,pp=2,vpp=2,schedule=dualpipev",
    "dp=2,cp=2,zero=3,recompute=full", "tp=2,sp,cp=2,zero=2,recompute=selective"])
def test_sp_cp_programs_validate_and_simulate(strategy):
    s = Strategy.parse(strategy)
    prog = compile(SPEC, s, global_batch=GB, seq_len=SEQ, validate=True)
    r = simulate(prog, "a100-1x8")
    assert r.step_time > 0 and len(r.peak_memory) == s.world


def test_sp_and_cp_shrink_simulated_activations():
    def act(strategy):
        return float(simulate(compile("llama2-7b", strategy, global_batch=16, seq_len=4096), "a100-2x8")
                     .memory_frame()["activations"].max())
    tp = act("dp=4,tp=4")
    assert act("dp=4,tp=4,sp") == pytest.approx(tp * 0.55, rel=0.25)      # the 10sbh terms shrink by t
    assert act("dp=4,cp=4") < 0.3 * act("dp=16")                        # s/cp tokens per rank


@pytest.mark.parametrize("src,dst", [("dp=2,cp=2,zero=1", "dp=4,zero=1"), ("tp=2,sp,cp=2", "tp=2,pp=2"),
                                     ("cp=4,zero=3", "dp=2,cp=2,zero=2")])
def test_switch_plans_cover_cp(src, dst):
    plan = vps.plan_switch(SPEC, src, dst, cluster="a100-1x8")
    plan.verify()
    if Strategy.parse(src).zero == Strategy.parse(dst).zero == 0:
        assert plan.stats()["bytes_moved"] == plan.stats()["bytes_needed"]


def test_dualpipev_with_both_sp_and_cp_lowers_to_a_program_that_runs():
    """The K/V-grad scatter is anchored after the SP reduce-scatter that waits on it; the lowering
    must order the comm stream so DualPipeV's interleaved fwd/bwd pairs cannot wait on each other."""
    from parashift import models as _m
    from parashift import sim as _sim
    spec = _m.get("gpt3-1.3b")
    prog = compile(spec, "tp=2,pp=2,vpp=2,schedule=dualpipev,cp=2,sp", global_batch=8, validate=True)
    r = _sim.simulate(prog, "a100-1x8", model=spec)
    assert 0 < r.step_time < float("inf")


@pytest.mark.parametrize("strategy", ["cp=2", "tp=2,sp,cp=2,pp=2,schedule=zb-h1"])
def test_kv_exchanges_sit_where_their_data_exists(strategy):
    """Forward K/V gather after the attention compute that makes K/V; backward gather before the
    attention backward; K/V-grad scatter after it and before a split backward's weight half."""
    prog = compile(SPEC, strategy, global_batch=GB, seq_len=SEQ, validate=True)
    for rp in prog.ranks.values():
        order = {i.id: (s, k) for s, ins in rp.streams.items() for k, i in enumerate(ins)}
        by_id = {i.id: i for i in rp.instrs()}

        def before(a, b):      # a completes before b starts (same stream order or a dependency chain)
            todo, seen = [b], set()
            while todo:
                x = todo.pop()
                if x == a:
                    return True
                if x in seen:
                    continue
                seen.add(x)
                s, k = order[x]
                todo += list(by_id[x].deps) + ([rp.streams[s][k - 1].id] if k else [])
            return False
        comp = {(i.region, i.phase, i.microbatch): i.id for i in rp.instrs() if i.op == "compute"}
        n = 0
        for i in rp.instrs():
            if not (i.tag or "").startswith("cp."):
                continue
            t = parse_tag(i.tag)
            a = comp[(t.region, t.phase, t.mb)]
            if t.phase == "fwd" or t.part == "dkv":
                assert before(a, i.id), i
            else:
                assert before(i.id, a), i
            if t.part == "dkv" and (t.region, "bwd_weight", t.mb) in comp:
                assert before(i.id, comp[(t.region, "bwd_weight", t.mb)]), i
            n += 1
        assert n
