"""ir.stamp: a step's DAG stamped from two micro-batches is the DAG the directives build for all of them."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parashift import Strategy, models
from parashift.errors import StrategyError
from parashift.ir import Graph, Split, compile, compile_graph, model_graph
from parashift.ir import stamp as S
from parashift.ir.recipe import base_graph as _base
from parashift.ir.compile import directives as recipe
from parashift.ir.schedules import get_schedule, schedule_names

D = importlib.import_module("parashift.ir.directives")
SEQ = 16


@pytest.fixture
def stamps(monkeypatch):
    """Stamp every step of at least one micro-batch; the list records whether each stamping took
    all the stampable directives (False: a shorter part, or none)."""
    made: list[bool] = []
    real = S.apply_stamped

    def spy(g, steps, m):
        out, k = real(g, steps, m)
        made.append(k == len(steps))
        return out, k

    monkeypatch.setattr(S, "STAMP_FROM", 1)
    monkeypatch.setattr(S, "apply_stamped", spy)
    return made


def _both(model, s, gb, seq=SEQ):
    """(stamped, unstamped) distributed graphs of one step; the stampable directives all stamp (but
    Replicate's parameter gathers at the head of the step, for micro-batch 0 alone, under overlap_param)."""
    spec = models.get(model)
    ds = recipe(spec, s, global_batch=gb, seq_len=seq)
    g = _base(spec, s, seq)
    k = D._stampable(ds)
    gathers = s.overlap_param and s.zero_ways > 1
    assert S.apply_stamped(g, ds[:k], ds[0].microbatches)[1] == \
        (next(i for i, x in enumerate(ds) if isinstance(x, D.Replicate)) if gathers else k)
    return D.apply_all(g, ds, stamp=True), D.apply_all(g, ds, stamp=False)


@st.composite
def cases(draw):
    model = draw(st.sampled_from(["tiny-gpt", "tiny-moe"]))
    spec = models.get(model)
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    cp = 1 if spec.is_moe else draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if dp % d == 0 and (spec.is_moe or d == 1)]))
    sched = draw(st.sampled_from(schedule_names()))
    vpp = get_schedule(sched).vpp_choices((2,))[0]
    if pp * vpp > spec.layers:
        vpp, sched = 1, "1f1b"
    zero = draw(st.integers(0, 3))
    try:
        s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero=zero, vpp=vpp, schedule=sched,
                     sp=tp > 1 and draw(st.booleans()), tp_async=tp > 1 and draw(st.booleans()),
                     overlap_grad=draw(st.booleans()), overlap_param=zero in (1, 2) and draw(st.booleans()),
                     shard=2 if dp == 4 and zero >= 1 and ep == 1 and cp == 1 and draw(st.booleans()) else 0,
                     mbs=draw(st.sampled_from([1, 2])), recompute=draw(st.sampled_from(["none", "selective", "full"])))
        s.validate(spec)
    except StrategyError:
        s = Strategy(dp=dp, pp=pp, zero=zero)
    m = draw(st.integers(1, 4)) * pp
    return model, s, s.dp * s.mbs * m


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_stamped_step_is_the_applied_one(case):
    """Node by node and edge by edge (values and types), then the lowered Program, the same."""
    model, s, gb = case
    a, b = _both(model, s, gb)
    assert S._same(a, b)
    progs = []
    old = S.STAMP_FROM
    try:
        for S.STAMP_FROM in (1, 10 ** 9):
            progs.append(compile(model, s, global_batch=gb, seq_len=SEQ).to_json())
    finally:
        S.STAMP_FROM = old
    assert progs[0] == progs[1]


@pytest.mark.parametrize("model,strategy", [
    ("tiny-gpt", "dp=2,tp=2,pp=2,sp,tp_async,recompute=full"), ("tiny-moe", "dp=4,pp=2,ep=2,zero=2"),
    ("tiny-gpt", "dp=2,cp=2,pp=2,vpp=2,schedule=dualpipev,zero=3"), ("tiny-gpt", "dp=4,pp=2,zero=1,shard=2"),
    ("tiny-gpt", "pp=4,schedule=zb-h1,tp=2,recompute=selective"), ("tiny-gpt", "dp=2,zero=2,overlap_grad")])
def test_presets_stamp(stamps, model, strategy):
    """The recipes' directives stamp (the check never falls back for them), to the same Program."""
    s = Strategy.parse(strategy)
    gb = s.dp * 4 * s.pp
    stamped = compile(model, s, global_batch=gb, seq_len=SEQ)
    assert stamps == [True]
    S.STAMP_FROM = 10 ** 9
    assert compile(model, s, global_batch=gb, seq_len=SEQ) == stamped
    assert stamps == [True]


def test_traced_graphs_stamp(stamps):
    """compile_graph's directives on a region graph stamp too."""
    g = model_graph(models.get("tiny-gpt"), mbs=1, seq_len=SEQ)
    prog = compile_graph(g, "dp=2,pp=2", global_batch=16)
    assert stamps == [True]
    S.STAMP_FROM = 10 ** 9
    assert compile_graph(g, "dp=2,pp=2", global_batch=16) == prog


def test_user_directives_on_a_preset_stamp(stamps):
    """compile(directives=...) (a placement of its own, a user stream) stamps, to the same Program."""
    from parashift import directives as d
    ds = [d.Place({"*": 0, "layers.2-3": 1, "head": 1}), d.Stream("mine", ops=("all_reduce",))]
    prog = compile("tiny-gpt", "dp=2,tp=2", global_batch=16, seq_len=SEQ, directives=ds)
    assert stamps == [True]
    S.STAMP_FROM = 10 ** 9
    assert compile("tiny-gpt", "dp=2,tp=2", global_batch=16, seq_len=SEQ, directives=ds) == prog


@dataclasses.dataclass(frozen=True)
class _FirstOnly:
    """Claims to be stampable but marks micro-batch 0 alone."""

    stampable = True

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        out.cols["key"] = ["first" if mb == 0 else k for mb, k in zip(out.cols["mb"], out.cols["key"])]
        return out


@dataclasses.dataclass(frozen=True)
class _Across:
    """Joins each micro-batch's first node to the next micro-batch's."""

    stampable = True

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        first = {}
        for i, mb in enumerate(out.cols["mb"]):
            first.setdefault(mb, i)
        for mb in first:
            if mb + 1 in first:
                out.edge(first[mb], first[mb + 1])
        return out


def test_overlap_param_stamps_up_to_replicate(stamps):
    """ZeRO's parameter gathers at the head of the step belong to micro-batch 0's actions alone: the
    directives before Replicate stamp, Replicate runs on the stamped graph."""
    a, b = _both("tiny-gpt", Strategy.parse("dp=2,pp=2,zero=1,overlap_param"), 32)
    assert stamps == [False, False] and S._same(a, b)    # _both checks how far it stamps, then stamps


@pytest.mark.parametrize("odd", [_FirstOnly(), _Across()])
def test_a_directive_that_does_not_stamp_is_applied(odd):
    """A directive whose result is no stamp of two micro-batches is refused by the check and applied."""
    g = model_graph(models.get("tiny-gpt"), mbs=1, seq_len=SEQ)
    steps = [Split(microbatches=6), odd]
    assert S.apply_stamped(g, steps, 6)[1] == 1       # the Split alone
    assert S._same(D.apply_all(g, steps, stamp=True), D.apply_all(g, steps, stamp=False))


def test_layout_reads_blocks_and_shared_rows():
    g = D.apply_all(model_graph(models.get("tiny-gpt"), mbs=1, seq_len=SEQ), [Split(microbatches=2)], stamp=False)
    nodes, edges = S.layout(g)
    n = len(g) // 2
    assert nodes == [(0, n, True)] and edges == [(0, len(g.src) // 2, True)]
    g.add(op="compute", phase="optim")
    g.edge(0, len(g) - 1)
    with pytest.raises(S._Unstampable):
        S.layout(g)                   # micro-batch 0's edge to the shared node has no twin
    g.edge(n, len(g) - 1)
    e = len(g.src) - 2
    assert S.layout(g) == ([(0, n, True), (2 * n, 1, False)], [(0, e // 2, True), (e, 1, True)])
    assert S._same(S.stamp(g, 2), g)
    g.edge(0, n)                      # micro-batch 0 -> micro-batch 1
    with pytest.raises(S._Unstampable):
        S.layout(g)


def test_series_names_each_micro_batch():
    f = S._Series(12)
    assert f("rc.layers.1.attn.m0", "rc.layers.1.attn.m1")[11] == "rc.layers.1.attn.m11"
    assert f((("zg.c0.m0", 8),), (("zg.c0.m1", 8),))[10] == (("zg.c0.m10", 8),)
    assert f(3, 5)[4] == 11
    with pytest.raises(S._Unstampable):
        f("x.m01", "x.m11")       # a micro-batch followed by a digit: 101 could be m10 or m1
    with pytest.raises(S._Unstampable):
        f(1.0, 2.0)
