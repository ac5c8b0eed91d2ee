"""Cost-aware zero-bubble planning: the time-based list scheduler, the cost estimate and the p2p
pair order that follows it, checked against the simulator (zb-h1 must beat 1f1b under TP)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import parashift as ps
from parashift import Strategy, models
from parashift.errors import StrategyError
from parashift.ir import Action, compile
from parashift.ir import schedules as S
from parashift.cluster import get
from parashift.ir.actions import stage_orders
from parashift.ir.costs import COMPUTE_EFFICIENCY, estimate_costs
from parashift.ir.model_graph import core_attention_flops


def _step(model: str, strategy: str, cluster: str, global_batch: int, seq_len: int | None) -> float:
    prog = compile(model, strategy, global_batch=global_batch, seq_len=seq_len)
    return ps.sim.simulate(prog, ps.cluster.get(cluster)).step_time


@pytest.mark.parametrize("model,strategy,cluster,gb,seq", [
    ("tiny-gpt", "dp=1,tp=2,pp=4", "a800-1x8", 16, None),
    ("llama2-70b", "dp=4,tp=8,pp=4,zero=1", "a800-16x8", 128, 4096),
    ("llama2-7b", "dp=8,pp=4", "a800-4x8", 128, 4096),   # tp=1 keeps winning too
])
def test_zb_h1_beats_1f1b(model, strategy, cluster, gb, seq):
    one = _step(model, strategy + ",schedule=1f1b", cluster, gb, seq)
    zb = _step(model, strategy + ",schedule=zb-h1", cluster, gb, seq)
    assert zb < one


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4)])
def test_equal_costs_reproduce_the_unit_order(pp, m):
    unit = S.zb_h1(pp, m)
    assert S.zb_h1(pp, m, S.ScheduleCosts.uniform(pp, 2.5, 2.5, 2.5)) == unit
    assert S.dualpipev(pp, m, S.ScheduleCosts.uniform(2 * pp, 3.0, 3.0, 3.0)) == S.dualpipev(pp, m)


def _check(pp: int, m: int, chunk_stage: list[int], orders: S.Orders, limit: int | None) -> None:
    chunks = len(chunk_stage)
    seen: dict[Action, tuple[int, int]] = {}
    for s, steps in orders.items():
        inflight = 0
        for k, step in enumerate(steps):
            for a in step:
                assert chunk_stage[a.chunk] == s and a not in seen
                seen[a] = (s, k)
                inflight += 1 if a.type == "F" else -1 if a.type == "I" else 0
            if limit is not None:  # zb-h1 keeps 1F1B's bound: at most pp - s forwards await their I
                assert inflight <= limit - s
    assert len(seen) == 3 * chunks * m
    for a, (s, k) in seen.items():
        if a.type == "W":
            assert seen[Action(a.chunk, "I", a.mb)][1] < k
        if a.type == "I":
            assert seen[Action(a.chunk, "F", a.mb)][1] < k


@settings(max_examples=40, deadline=None)
@given(pp=st.sampled_from([2, 3, 4]), mult=st.integers(1, 3),
       f=st.floats(0.2, 4.0), i=st.floats(0.2, 4.0), w=st.floats(0.2, 4.0), p2p=st.floats(0.0, 3.0))
def test_any_costs_give_complete_bounded_orders(pp, mult, f, i, w, p2p):
    m = pp * mult
    zb = S.zb_h1(pp, m, S.ScheduleCosts.uniform(pp, f, i, w, p2p))
    _check(pp, m, list(range(pp)), zb, limit=pp)
    dv = S.dualpipev(pp, m, S.ScheduleCosts.uniform(2 * pp, f, i, w, p2p))
    _check(pp, m, [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)], dv, limit=None)


def test_weight_grads_only_fill_waits():
    """With a long I and a short W the last stage runs each arriving F and I before a W (ZB-H1: a
    stage defers up to pp-1 weight-grads) and never holds more than pp-1 of them; stage 0 keeps
    1F1B's warm-up."""
    pp, m = 4, 8
    orders = S.zb_h1(pp, m, S.ScheduleCosts.uniform(pp, 1.0, 1.4, 0.7, 0.05))
    last = " ".join(map(str, (a for (a,) in orders[pp - 1])))
    assert last.startswith("3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0")
    pending = 0
    for (a,) in orders[pp - 1]:
        pending += {"I": 1, "W": -1, "F": 0}[a.type]
        assert pending <= pp
    first = [a for (a,) in orders[0]]
    assert [str(a) for a in first[:pp]] == ["0F0", "0F1", "0F2", "0F3"]  # 1F1B warm-up kept


def test_costs_are_validated():
    with pytest.raises(StrategyError, match="one F, I and W duration per chunk"):
        S.ScheduleCosts((1.0,), (1.0, 1.0), (1.0,))
    with pytest.raises(StrategyError, match="positive"):
        S.ScheduleCosts((1.0,), (0.0,), (1.0,))
    with pytest.raises(StrategyError, match="2 chunks"):
        S.zb_h1(4, 4, S.ScheduleCosts.unit(2))


def test_estimate_reflects_tp_communication():
    spec = models.get("llama2-70b")
    c1 = estimate_costs(spec, Strategy.parse("dp=4,pp=4"), 4096, "a800-16x8")
    c8 = estimate_costs(spec, Strategy.parse("dp=4,tp=8,pp=4"), 4096, "a800-16x8")
    # no TP: W runs the GEMMs once more, F adds the core attention (QK^T, AV) and I twice that (its backward)
    core = core_attention_flops(spec, 4096, 4096) * 20 / (get("a800-16x8").gpu.peak_flops * COMPUTE_EFFICIENCY)
    assert c1.f[1] - c1.w[1] == pytest.approx(core) and c1.i[1] - c1.w[1] == pytest.approx(2 * core)
    # with TP the all-reduces lengthen F and I only
    assert c8.i[1] > 1.2 * c8.w[1] and c8.i[1] - c8.f[1] == pytest.approx(core / 8)
    assert c8.f[-1] > c8.f[0]  # the head sits on the last chunk
    full = estimate_costs(spec, Strategy.parse("dp=4,tp=8,pp=4,recompute=full"), 4096, "a800-16x8")
    assert full.i[1] > 1.8 * c8.w[1] and full.w == c8.w


def test_compile_accepts_costs_or_a_cluster():
    strat = "dp=1,tp=2,pp=2,schedule=zb-h1"
    given_costs = S.ScheduleCosts.uniform(2, 1.0, 1.0, 1.0)
    prog = compile("tiny-gpt", strat, global_batch=4, seq_len=16, costs=given_costs).validate()
    assert [str(a) for a in stage_orders(prog)[1]] == [str(a) for (a,) in S.zb_h1(2, 4)[1]]
    compile("tiny-gpt", strat, global_batch=4, seq_len=16, costs="h100-1x8").validate()
    tied = models.gpt(4, 64, 4, ffn=128, vocab=256, seq_len=16, name="tied", tied=True, dtype="fp32", pad_vocab=8)
    # p2p latency far above compute: the V's second-chunk forwards keep the in-flight bound deadlock-free
    compile(tied, "dp=1,pp=2,vpp=2,schedule=dualpipev", global_batch=8, seq_len=16,
            costs=estimate_costs(tied, Strategy.parse("dp=1,pp=2,vpp=2,schedule=dualpipev"), 16)).validate()
