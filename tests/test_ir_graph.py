"""The training DAG and each directive as a pure graph rewrite."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parashift import Strategy, models
from parashift.errors import ProgramError
from parashift.ir import DATA, SAVED, Graph, model_graph
from parashift.ir.compile import directives, distributed_graph
from parashift.ir.directives import Fuse, Order, Place, Replicate, Shard, Split, Stream
from parashift.ir.memory import region_state_bytes

SPEC = models.get("tiny-gpt")
R = 1 + 2 * SPEC.layers + 1  # embed, attn/mlp per layer, head


def chain(n=3):
    g = Graph()
    for i in range(n):
        g.add(op="compute", phase="fwd", region=f"r{i}", flops=float(i))
        if i:
            g.edge(i - 1, i)
    return g


def reach(g: Graph, u: int, v: int) -> bool:
    s, d = g.edges()
    adj: dict[int, list[int]] = {}
    for a, b in zip(s.tolist(), d.tolist()):
        adj.setdefault(a, []).append(b)
    seen, stack = {u}, [u]
    while stack:
        x = stack.pop()
        for y in adj.get(x, ()):
            if y == v:
                return True
            if y not in seen:
                seen.add(y)
                stack.append(y)
    return False


def test_graph_basics_and_cycles():
    g = chain()
    assert g.topo_order().tolist() == [0, 1, 2]
    assert g.is_acyclic() and g.find_cycle() == []
    assert g.totals()["compute"]["flops"] == 3.0
    g.edge(2, 0)
    cyc = g.find_cycle()
    assert cyc[0] == cyc[-1] and set(cyc) == {0, 1, 2}
    with pytest.raises(ProgramError, match="cycle"):
        g.topo_order()
    with pytest.raises(ProgramError, match="unknown node attribute"):
        g.add(colour="red")
    assert list(g.to_frame().columns[:3]) == ["op", "phase", "region"]
    assert "r1" in str(g.node(1))


def test_model_graph_is_a_region_chain():
    g = model_graph(SPEC, mbs=2, seq_len=16)
    assert len(g) == R and g.col("region")[:3] == ["embed", "layers.0.attn", "layers.0.mlp"]
    assert list(zip(g.src, g.dst)) == [(i, i + 1) for i in range(R - 1)]
    assert sum(g.col("flops")) == pytest.approx(SPEC.flops_per_token(16) / 3 * 32)
    moe = model_graph(models.get("tiny-moe"))
    assert moe.col("kind")[1:5] == ["attn", "moe.route", "moe.experts", "moe.combine"]


def test_split_microbatches_and_backward():
    g = Split(microbatches=3).apply(model_graph(SPEC))
    assert len(g) == 3 * 2 * R
    assert g.col("phase").count("bwd") == 3 * R
    assert g.is_acyclic()
    # loss edge and stashed activations: each region's fwd reaches its bwd
    assert all(reach(g, i, i + R) for i in range(R))
    s = Split(backward=True).apply(g)
    assert s.col("phase").count("bwd_input") == s.col("phase").count("bwd_weight") == 3 * R
    assert s.is_acyclic()
    with pytest.raises(ProgramError, match="single-device forward graph"):
        Split(microbatches=2).apply(g)


def test_place_adds_send_recv_pairs():
    s = Strategy(pp=2)
    g = Split(microbatches=2).apply(model_graph(SPEC))
    p = Place(tuple(s.layer_stages(SPEC.layers).tolist()), (0, 1), act_bytes=100).apply(g)
    ops = p.col("op")
    assert ops.count("send") == ops.count("recv") == 2 * 2  # act + grad per micro-batch
    tags = sorted(t for t, o in zip(p.col("tag"), ops) if o == "send")
    assert tags == ["act.c0.m0", "act.c0.m1", "grad.c0.m0", "grad.c0.m1"]
    assert p.col("phase").count("optim") == 2
    assert p.is_acyclic()
    assert reach(p, 0, R) and reach(p, 0, R - 1)  # embed fwd -> head fwd -> ... -> embed bwd, across stages


def test_shard_tp_and_ep():
    g = Place((0, 0, 0, 0), (0,), act_bytes=8).apply(Split(microbatches=1).apply(model_graph(SPEC)))
    t = Shard("tp", 2, nbytes=8, stats_bytes=4).apply(g)
    assert t.col("op").count("all_reduce") == 1 + 2 * SPEC.layers * 2 + 1
    assert t.col("op").count("all_gather") == 1
    fl = np.asarray(g.col("flops"))
    assert sum(t.col("flops")[:len(g)]) == pytest.approx(fl.sum() / 2)
    assert t.is_acyclic()
    assert Shard("tp", 1, nbytes=8).apply(g).col("op") == g.col("op")
    moe = models.get("tiny-moe")
    gm = Place((0,) * 4, (0,), act_bytes=8).apply(Split(microbatches=1).apply(model_graph(moe)))
    e = Shard("ep", 2, nbytes=8).apply(gm)
    assert e.col("op").count("all_to_all") == 4 * moe.layers
    with pytest.raises(ProgramError, match="not supported"):
        Shard("sp", 2, nbytes=8).apply(gm)


def test_replicate_adds_grad_sync_and_zero3_gathers():
    s = Strategy(dp=2, zero=3)
    ds = directives(SPEC, s, global_batch=4, seq_len=16)
    g = model_graph(SPEC, seq_len=16)
    for d in ds:
        g = d.apply(g)
        if isinstance(d, Replicate):
            break
    ops = list(zip(g.col("op"), g.col("tag")))
    regions = [r for r, _, _ in region_state_bytes(SPEC, s)]
    rs = sorted(t for o, t in ops if o == "reduce_scatter")     # one per region's bucket and micro-batch
    assert rs == sorted(f"dp.grad.c0.m{m}.{r}" for m in (0, 1) for r in regions)
    gathers = [t for o, t in ops if o == "all_gather" and t.startswith("z3.param")]   # per region: fwd+bwd per mb
    assert sorted(gathers) == sorted(f"z3.param.c0.{ph}.m{m}.{r}" for ph in ("fwd", "bwd") for m in (0, 1)
                                     for r in regions)
    assert g.is_acyclic()


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_zero3_region_gathers_prefetch(prefetch):
    """ZeRO-3 on an unfused dense graph: a region's gather of an action waits for the region
    ``1 + prefetch`` places before it, so at most ``1 + prefetch`` region copies are gathered ahead."""
    s = Strategy(dp=2, zero=3)
    g = model_graph(SPEC, seq_len=16)
    for d in directives(SPEC, s, global_batch=4, seq_len=16):
        g = (dataclasses.replace(d, prefetch=prefetch) if isinstance(d, Replicate) else d).apply(g)
        if isinstance(d, Replicate):
            break
    c = g.cols
    fwd = sorted((i for i in range(len(g)) if c["op"][i] == "compute" and c["phase"][i] == "fwd" and c["mb"][i] == 0),
                 key=lambda i: c["pos"][i])
    gather = {c["tag"][i].split(".", 5)[-1]: i for i in range(len(g))
              if c["op"][i] == "all_gather" and c["tag"][i].startswith("z3.param.c0.fwd.m0.")}
    waits = {(u, v) for u, v in zip(g.src, g.dst)}
    for j, i in enumerate(fwd):
        before = {fwd[k] for k in range(j) if (fwd[k], gather[c["region"][i]]) in waits}
        assert before == ({fwd[j - 1 - prefetch]} if j - 1 - prefetch >= 0 else set()), (prefetch, c["region"][i])


def test_stream_and_fuse():
    g = distributed_graph(SPEC, "dp=2,pp=2", global_batch=4, seq_len=16)
    assert set(g.col("kind")) >= {"fused"}
    assert g.is_acyclic()
    moved = Stream("comm", ops=("send",)).apply(g)
    assert {s for s, o in zip(moved.col("stream"), moved.col("op")) if o == "send"} == {"comm"}
    # fusing an already fused graph changes nothing
    assert Fuse().apply(g).col("region") == g.col("region")


def test_every_pipeline_keeps_the_data_dependencies():
    s = Strategy(dp=2, tp=2, pp=2, zero=3, recompute="full", schedule="zb-h1")
    g = distributed_graph(SPEC, s, global_batch=4, seq_len=16)
    assert g.is_acyclic((DATA, SAVED))
    # each micro-batch still flows from the embedding's forward to the embedding's weight grad
    for mb in range(2):
        f = [i for i in range(len(g)) if g.col("region")[i] == "embed" and g.col("phase")[i] == "fwd"
             and g.col("mb")[i] == mb][0]
        w = [i for i in range(len(g)) if g.col("region")[i] == "embed" and g.col("phase")[i] == "bwd_weight"
             and g.col("mb")[i] == mb][0]
        assert reach(g, f, w)


def test_order_needs_a_placed_graph():
    g = Split(microbatches=1).apply(model_graph(SPEC))
    with pytest.raises(ProgramError, match="belongs to no action|not on this stage"):
        Order({0: "0F0 0B0"}).apply(g)


def test_graph_clone_copies_rows_with_overrides():
    g = Graph()
    a = g.add(op="compute", phase="fwd", region="layers.0.mlp", mb=1, flops=2.0)
    b = g.add(op="compute", phase="bwd", region="layers.1.mlp", mb=3, flops=5.0, alloc=(("x", 4),))
    new = g.clone([b, a], phase="recompute", flops=[7.0, 8.0])
    assert list(new) == [2, 3]
    assert [g.node(i).region for i in new] == ["layers.1.mlp", "layers.0.mlp"]
    assert [g.node(i).phase for i in new] == ["recompute", "recompute"]
    assert [g.node(i).flops for i in new] == [7.0, 8.0]
    assert g.node(2).alloc == (("x", 4),) and g.node(2).mb == 3
    assert g.node(b).phase == "bwd"                  # the originals are untouched
    assert list(g.clone([a])) == [4] and g.node(4).flops == 2.0
    with pytest.raises(ProgramError, match="unknown node attribute"):
        g.clone([a], colour="red")
    with pytest.raises(ProgramError, match="2 values for 1 nodes"):
        g.clone([a], flops=[1.0, 2.0])


def test_apply_all_rewrites_only_its_own_scratch_graphs():
    from parashift.ir.recipe import base_graph as _base
    from parashift.ir.directives import apply_all
    s = Strategy.parse("dp=2,tp=2,pp=2,recompute=full")
    g = _base(SPEC, s, 64)
    before = (g.copy().cols, list(g.src), list(g.dst), list(g.ekind))
    steps = directives(SPEC, s, global_batch=8, seq_len=64)
    out = apply_all(g, steps)
    assert (g.cols, g.src, g.dst, g.ekind) == before                 # the input is not changed
    assert not out._scratch and out.owned() is not out              # nor is the result, by a later directive
    one = g
    for d in steps:                                                 # the same graph as one copy per directive
        one = d.apply(one)
    assert (one.cols, one.src, one.dst, one.ekind) == (out.cols, out.src, out.dst, out.ekind)
