"""tp_async and grad_fusion (Megatron-LM's asynchronous backward TP all-reduce and gradient-accumulation
fusion): strategy parsing, the Program the IR builds (the input-gradient reduction on stream "tp" beside
the weight gradients) and what the simulator makes of it."""
from __future__ import annotations

import pytest

from parashift import Strategy, cluster as clusters, models
from parashift.errors import ProgramError, StrategyError
from parashift.ir import compile
from parashift.ir.directives import TP_BWD_KINDS, Split
from parashift.ir.model_graph import model_graph
from parashift.sim import CostModel, simulate

SPEC = models.get("tiny-gpt")
SEQ, GB = 32, 4


def test_parse_round_trip_and_errors():
    s = Strategy.parse("tp=2,tp_async,grad_fusion")
    assert (s.tp_async, s.grad_fusion) == (True, True) and str(s) == "dp=1,tp=2,pp=1,tp_async,grad_fusion"
    assert Strategy.parse(str(s)) == s and Strategy.parse("tp=2,tp_async=0").tp_async is False
    assert Strategy.parse("dp=2,grad_fusion").grad_fusion            # no TP needed to fuse accumulation
    with pytest.raises(StrategyError, match="tp_async .* needs tp > 1; set tp=2 or more, or drop tp_async"):
        Strategy.parse("dp=2,tp_async")
    with pytest.raises(StrategyError, match="must be on or off"):
        Strategy.parse("tp=2,grad_fusion=maybe")
    with pytest.raises(StrategyError, match="must be a boolean"):
        Strategy(tp=2, tp_async=1)


def _streams(prog, rank=0):
    rp = prog.ranks[rank]
    by_id = {i.id: i for i in rp.instrs()}
    return rp, by_id


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_backward_all_reduce_runs_on_tp_stream_beside_the_weight_gradients(recompute):
    prog = compile(SPEC, f"tp=2,pp=2,tp_async,recompute={recompute}", global_batch=GB, seq_len=SEQ, validate=True)
    for rank in (0, 2):
        rp, by_id = _streams(prog, rank)
        ars = rp.streams["tp"]
        assert ars and all(i.op == "all_reduce" and i.group == "tp" and i.phase == "bwd_input" for i in ars)
        compute = rp.streams["compute"]
        assert not any(i.op != "compute" and i.phase in ("bwd", "bwd_input") for i in compute)
        pos = {i.id: k for k, i in enumerate(compute)}
        for ar in ars:
            (src,) = ar.deps                                   # starts when the input gradient is computed
            inp = by_id[src]
            assert (inp.phase, inp.microbatch) == ("bwd_input", ar.microbatch) and inp.region in ar.tag
            w = compute[pos[src] + 1]                           # the weight half runs right after, not waiting
            assert (w.phase, w.region, w.microbatch) == ("bwd_weight", inp.region, inp.microbatch)
            assert ar.id not in w.deps
            waiting = [i for i in rp.instrs() if ar.id in i.deps]   # the gradient chain waits (compute or p2p)
            assert waiting and all(pos[i.id] > pos[w.id] for i in waiting if i.stream == "compute")
            nxt = [i for i in waiting if i.stream == "compute" and i.phase != "optim" and i.region != "embed"]
            if nxt and nxt[0].phase == "fwd":                   # the B's last reduction: the next step's
                prev = compute[pos[nxt[0].id] - 1]              # first kernel waits for it
                assert prev.phase == "bwd_weight" and prev.microbatch == ar.microbatch
            elif recompute == "full" and nxt:
                assert nxt[0].phase == "recompute"              # the next kernels wait, as Megatron's do
            elif nxt:
                assert nxt[0].phase == "bwd_input"
        optim = next(i for i in compute if i.phase == "optim")
        assert ars[-1].id in optim.deps                         # the gradients are whole when the last lands
        kinds = {by_id[a.deps[0]].region.split(".")[-1] for a in ars}
        assert kinds <= set(TP_BWD_KINDS) and kinds


@pytest.mark.parametrize("strategy", ["tp=2,pp=2,tp_async", "tp=2,pp=2,vpp=2,schedule=interleaved-1f1b,tp_async",
                                      "tp=2,sp,pp=2,tp_async,recompute=full"])
def test_next_step_waits_for_the_last_backward_reduction(strategy):
    """Megatron's backward waits for its asynchronous all-reduce before returning: the compute after a
    B action (a forward in 1F1B's steady state) never overlaps the B's last TP reduction."""
    prog = compile(SPEC, strategy, global_batch=GB, seq_len=SEQ, validate=True)
    checked = 0
    for rp in prog.ranks.values():
        compute = rp.streams["compute"]
        tp_ids = {i.id for i in rp.streams["tp"]}
        last_tp = None
        for k, (prev, cur) in enumerate(zip(compute, compute[1:])):
            if prev.phase in ("bwd", "bwd_input", "bwd_weight"):
                mine = [i for i in rp.streams["tp"] if i.microbatch == prev.microbatch and i.chunk == prev.chunk]
                last_tp = mine[-1].id if mine else None
            if prev.phase in ("bwd", "bwd_weight") and cur.phase == "fwd" and last_tp in tp_ids:
                # directly, or through a kernel before it on the compute stream
                assert any(last_tp in x.deps for x in compute[:k + 2]), \
                    f"{cur} starts before the reduction {last_tp} of the B before it"
                checked += 1
    assert checked


def test_sequence_parallel_reduce_scatter_and_regather_on_tp_stream():
    prog = compile(SPEC, "tp=2,sp,tp_async", global_batch=GB, seq_len=SEQ, validate=True)
    rp, by_id = _streams(prog)
    tp = rp.streams["tp"]
    assert {(i.op, i.key) for i in tp} == {("reduce_scatter", "sp_scatter"), ("all_gather", "sp_input")}
    weights = [i for i in rp.streams["compute"] if i.phase == "bwd_weight"]
    assert weights
    for w in weights:
        deps = [by_id[d] for d in w.deps]
        assert [d.key for d in deps] == ["sp_input"]            # needs its input gathered, not the reduction
        assert f"sp.{w.region}." in deps[0].tag and deps[0].microbatch == w.microbatch
    # the all-gather of the next block's output gradient stays on compute, after the weight half
    assert all(i.op == "all_gather" and i.key == "sp_gather" for i in rp.streams["compute"]
               if i.op != "compute" and i.phase == "bwd_input")


def test_off_by_default_and_unchanged():
    base = compile(SPEC, "tp=2,pp=2", global_batch=GB, seq_len=SEQ)
    assert set(base.ranks[0].streams) <= {"compute", "comm", "p2p"}
    assert not any(i.phase in ("bwd_input", "bwd_weight") for i in base.ranks[0].instrs())
    fused = compile(SPEC, "tp=2,pp=2,grad_fusion", global_batch=GB, seq_len=SEQ)
    assert [str(i) for i in fused.ranks[0].instrs()] == [str(i) for i in base.ranks[0].instrs()]


def test_split_keeping_actions_needs_a_placed_graph():
    g = Split(microbatches=2).apply(model_graph(SPEC, mbs=1, seq_len=SEQ))
    with pytest.raises(ProgramError, match="apply it after Place"):
        Split(backward=True, kinds=TP_BWD_KINDS, keep_action=True).apply(g)


BIG = models.gpt(8, 4096, 32, vocab=51200, seq_len=2048, gated=False, bias=True, norm="ln", pos_emb="learned",
                 tied=True, dtype="fp16", flash_attention=False, name="gpt-tp-heavy")
A100 = clusters.get("a100-1x8")


def _step(strategy: str, cm: "CostModel | None" = None) -> float:
    prog = compile(BIG, strategy, global_batch=4, seq_len=2048)
    return simulate(prog, A100, cm or CostModel.for_cluster(A100), model=BIG).step_time


def test_simulated_step_is_shorter_with_async_tp_all_reduce():
    base = "tp=8,mbs=1,recompute=full"
    t0, t1 = _step(base), _step(base + ",tp_async")
    assert t1 < t0 * 0.97                       # the backward all-reduces hide behind the weight gradients
    sp0, sp1 = _step(base + ",sp"), _step(base + ",sp,tp_async")
    assert sp1 < sp0


def test_grad_fusion_removes_exactly_the_accumulation_pass():
    cm = CostModel.for_cluster(A100)
    base = "tp=8,mbs=1,recompute=full"
    fused = _step(base + ",grad_fusion", cm)
    assert fused == pytest.approx(_step(base, cm.replace(grad_accum_traffic=0.0)), rel=1e-9)
    assert fused < _step(base, cm)


@pytest.mark.parametrize("strategy,label", [("tp=2,pp=2,tp_async", "zb-h1"),
                                            ("tp=2,pp=2,vpp=2,schedule=interleaved-1f1b,tp_async", "interleaved-1f1b")])
def test_user_split_backward_takes_over_tp_async_split(strategy, label):
    from parashift import directives as d
    p = compile(SPEC, strategy, global_batch=GB, seq_len=SEQ, directives=[d.Split(backward=True)], validate=True)
    rp = p.ranks[0]
    assert p.meta["schedule"] == label and rp.streams["tp"]
    assert not any(i.phase == "bwd" for i in rp.instrs())      # every backward split, the embedding's too


def test_weight_half_is_the_column_parallel_gemm_under_one_backward_action():
    """Megatron's order: the row-parallel GEMM's weight gradient is computed with the input gradient,
    only the column-parallel GEMM's overlaps the all-reduce; a split schedule's W keeps them all."""
    from parashift.cost import Workload
    from parashift.cost.compute import gemm_time
    cm = CostModel.for_cluster(A100)
    s = Strategy.parse("tp=8,tp_async")
    assert s.column_wgrad and not Strategy.parse("tp=8,pp=2,tp_async,schedule=zb-h1").column_wgrad
    on, off = Workload.of(BIG, s, 2048), Workload.of(BIG, Strategy.parse("tp=8"), 2048)
    h, q = BIG.hidden, BIG.heads * BIG.head_dim
    for kind, (m, n, k) in (("attn", (2048, (q + 2 * q) / 8, h)), ("mlp", (2048, BIG.ffn / 8, h))):
        assert on.time(cm, kind, "bwd_weight") == pytest.approx(gemm_time(cm, n, k, m), rel=1e-12)
        assert on.time(cm, kind, "bwd_input") + on.time(cm, kind, "bwd_weight") == \
            pytest.approx(off.time(cm, kind, "bwd"), rel=1e-12)
        assert off.time(cm, kind, "bwd_weight") > on.time(cm, kind, "bwd_weight")
    assert on.time(cm, "head", "bwd_weight") == off.time(cm, "head", "bwd_weight")   # one GEMM: all of it
