"""The schedule registry: every schedule is searchable and simulatable, obeys its anchor's rules,
and its simulated bubble on uniform stages follows its published formula."""
from __future__ import annotations

import dataclasses

import pytest

from parashift import Strategy, cluster, explore, models, search
from parashift import schedules as registry
from parashift.cost import CostModel
from parashift.errors import StrategyError
from parashift.ir import compile
from parashift.ir import schedules as S
from parashift.search.space import make_space
from parashift.sim import simulate

TINY = models.get("tiny-gpt")


@pytest.mark.parametrize("name", S.schedule_names())
def test_every_registered_schedule_is_searchable_and_simulatable(name):
    sched = S.get_schedule(name)
    space = make_space(TINY, "a100-1x8", devices=4, global_batch=8, seq_len=32, tp=(1,), pp=(2,), mbs=(1,),
                       zero=(0,), recompute=("none",), schedules=(name,))
    found = space.enumerate()
    assert found and all(s.schedule == name for s in found)
    assert {s.vpp for s in found} <= set(sched.vpp_choices(space.vpp))     # tiny-gpt: vpp=4 exceeds its layers
    for s in found:
        out = search.SimEvaluator(TINY, "a100-1x8", global_batch=8, seq_len=32, precheck=False)(s)
        assert out.step_time > 0, (name, str(s))


def test_a_registered_schedule_reaches_every_layer():
    """One register() call: parsing, validation, compile, costs and the search space all see it."""
    base = S.get_schedule("1f1b")
    new = dataclasses.replace(base, name="1f1b-copy", summary="1F1B under another name")
    S.register(new)
    try:
        s = Strategy.parse("dp=2,pp=2,schedule=1f1b-copy")
        assert "1f1b-copy" in S.schedule_names()
        prog = compile(TINY, s, global_batch=8, seq_len=32, validate=True)
        ref = compile(TINY, s.replace(schedule="1f1b"), global_batch=8, seq_len=32)
        assert [str(i) for i in prog.ranks[0].instrs()] == [str(i) for i in ref.ranks[0].instrs()]
        space = make_space(TINY, "a100-1x8", devices=4, global_batch=8, seq_len=32, pp=(2,), tp=(1,), mbs=(1,),
                           zero=(0,), recompute=("none",))
        assert any(x.schedule == "1f1b-copy" for x in space.enumerate())
        assert explore.schedule_strategy("dp=2,pp=2", "1f1b-copy").vpp == 1
        assert "1f1b-copy" in explore.compared_schedules()
    finally:
        registry._REGISTRY.pop("1f1b-copy")
    with pytest.raises(StrategyError, match="unknown schedule '1f1b-copy'"):
        Strategy.parse("pp=2,schedule=1f1b-copy")


def test_a_schedule_carries_its_recipe_or_names_a_built_in_one():
    """A record names a built-in recipe of ir.schedules or carries its own callable; a name no recipe
    has is refused with the choices."""
    s = Strategy.parse("dp=1,pp=2")
    gpipe = S.schedule_steps(s.replace(schedule="gpipe"), 4)
    own = dataclasses.replace(S.get_schedule("1f1b"), name="own", recipe=lambda st, m, c: S.gpipe(st.pp, m))
    typo = dataclasses.replace(S.get_schedule("1f1b"), name="typo", recipe="1f1bb")
    S.register(own)
    S.register(typo)
    try:
        assert S.schedule_steps(s.replace(schedule="own"), 4) == gpipe
        with pytest.raises(StrategyError, match="schedule typo names no known recipe \\('1f1bb'\\).*1f1b"):
            S.schedule_steps(s.replace(schedule="typo"), 4)
    finally:
        registry._REGISTRY.pop("own")
        registry._REGISTRY.pop("typo")


@pytest.mark.parametrize("name", S.schedule_names())
def test_explore_runs_every_registered_schedule(name):
    s = explore.schedule_strategy("dp=2,pp=2,zero=1", name, recompute="full")
    assert (s.schedule, s.recompute, s.dp, s.zero) == (name, "full", 2, 1)
    assert s.vpp in S.get_schedule(name).vpp_choices((2, 4))
    assert (name in explore.compared_schedules()) == (name != "gpipe")


def test_explore_names_the_registered_schedules_for_an_unknown_one():
    with pytest.raises(StrategyError, match="unknown schedule 'zb-h2'; use one of " + ", ".join(S.schedule_names())):
        explore.schedule_strategy("pp=2", "zb-h2")


# ---- rules ----------------------------------------------------------------------------------------------
def test_interleaved_rejects_uneven_splits_with_the_fix():
    spec = models.gpt(12, 256, 4, vocab=128, seq_len=64, name="l12", pad_vocab=128)
    probs = Strategy.parse("pp=4,vpp=2").problems(spec)          # 12 layers over 8 chunks
    assert len(probs) == 1 and "12 layers to split evenly over pp*vpp=8" in probs[0] and "vpp=3" in probs[0]
    with pytest.raises(StrategyError, match="split evenly"):
        compile(spec, "pp=4,vpp=2", global_batch=8, seq_len=64)
    assert Strategy.parse("pp=4,vpp=3").problems(spec) == []
    assert Strategy.parse("pp=4").problems(spec) == []              # 1F1B may split unevenly (3 per stage)
    with pytest.raises(StrategyError, match=r"micro-batch count \(6\) to be a multiple of pp=4"):
        Strategy.parse("pp=4,vpp=3").num_microbatches(6)
    # the search space does not offer what the anchor rejects
    space = make_space(spec, "a100-1x8", devices=4, global_batch=8, seq_len=64, tp=(1,), pp=(4,), mbs=(1,),
                       zero=(0,), recompute=("none",), schedules=("interleaved-1f1b",), vpp=(2, 3))
    assert [s.vpp for s in space.enumerate()] == [3]


def test_fixed_chunk_counts_come_from_the_record():
    assert S.get_schedule("dualpipev").vpp_choices((2, 4)) == (2,)
    assert S.get_schedule("interleaved-1f1b").vpp_choices((1, 2, 4)) == (2, 4)
    with pytest.raises(StrategyError, match="exactly 2 chunks per stage"):
        Strategy(pp=2, vpp=4, schedule="dualpipev")


# ---- bubbles on uniform stages --------------------------------------------------------------------------
UNI = models.gpt(16, 4096, 32, vocab=128, seq_len=2048, name="uniform", pad_vocab=128)


def _pipeline_bubble(r) -> float:
    """Mean over stages of idle over busy time inside the pipeline (first model compute to last), the
    formulas' definition: the optimizer step after the flush is neither busy nor idle pipeline time."""
    spans = [(a, b) for _, s, ins, a, b in r.raw.records if s == "compute" and ins.phase != "optim"]
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    busy: dict[int, float] = {}
    for rep, s, ins, a, b in r.raw.records:
        if s == "compute" and ins.phase != "optim":
            busy[rep] = busy.get(rep, 0.0) + b - a
    return sum((span - b) / b for b in busy.values()) / len(busy)


def _free_transfers(cm: CostModel) -> CostModel:
    """The formulas' assumptions: pipeline sends cost nothing (the A100 preset's fitted per-send overhead
    of ~1.6 ms, Megatron's host synchronisation after each batched send/recv, is what lifted every
    simulated bubble ~0.03 above its formula)."""
    return dataclasses.replace(cm, p2p_overhead=0.0, comm_overhead=0.0, step_p2p_posted=True,
                               latency={k: 0.0 for k in cm.latency}, bandwidth={k: 1e18 for k in cm.bandwidth})


@pytest.mark.parametrize("strategy,m", [
    ("pp=4", 8), ("pp=4,schedule=gpipe", 8), ("pp=4,vpp=2", 8), ("pp=4,vpp=4", 16), ("pp=2,vpp=4", 8),
    ("pp=4,schedule=zb-h1", 8), ("pp=2,schedule=zb-h1", 8), ("pp=4,vpp=2,schedule=dualpipev", 8),
    ("pp=2,vpp=2,schedule=dualpipev", 8)])
def test_simulated_bubble_follows_the_published_formula(strategy, m):
    """Idle over busy time of a stage: (p-1)/m (1F1B, GPipe), (p-1)/(v m) (interleaved),
    (p-1)(F+I-W)/(m(F+I+W)) (ZB-H1), (p-1)(F&B+B-3W)/(2m(F+I+W)) (DualPipeV, F&B = F+I), on uniform
    stages (no embedding or head: a vocabulary of 128) with free transfers, as the formulas assume."""
    s = Strategy.parse(strategy)
    cost = _free_transfers(CostModel.for_cluster(cluster.get("a100-1x8")))
    r = simulate(compile(UNI, s, global_batch=m, seq_len=2048), "a100-1x8", cost)
    f, i, w = _phase_times(r)
    want = S.get_schedule(s.schedule).bubble(s.pp, m, s.vpp, f, i, w)
    assert _pipeline_bubble(r) == pytest.approx(want, rel=0.05, abs=0.002)


def _phase_times(r) -> tuple[float, float, float]:
    """Mean simulated seconds of a chunk's forward, input backward and weight backward: the F, I, W of
    the formulas (a whole backward counts as two equal halves). The Program carries its model, so the
    kernel shapes price each phase, and the halves of a split backward differ."""
    t: dict[str, list[float]] = {}
    for _, s, ins, a, b in r.raw.records:
        if s == "compute" and ins.phase in ("fwd", "bwd", "bwd_input", "bwd_weight"):
            t.setdefault(ins.phase, []).append(b - a)
    mean = {k: sum(v) / len(v) for k, v in t.items()}
    if "bwd_input" in mean:
        return mean["fwd"], mean["bwd_input"], mean["bwd_weight"]
    return mean["fwd"], mean["bwd"] / 2, mean["bwd"] / 2


def test_pipeline_send_costs_add_to_the_formula_bubble():
    """With the preset's per-send cost the sends on the critical path idle the stages: in 1F1B the bubble
    exceeds the formula by at least the 2(p-1) sends of warm-up and cool-down and at most one round trip
    per micro-batch on top, over a stage's busy time."""
    cm = CostModel.for_cluster(cluster.get("a100-1x8"))
    free = _free_transfers(cm)
    paid = dataclasses.replace(free, p2p_overhead=cm.p2p_overhead)
    prog = compile(UNI, "pp=4", global_batch=8, seq_len=2048)
    r0, r1 = simulate(prog, "a100-1x8", free), simulate(prog, "a100-1x8", paid)
    b0, b1 = _pipeline_bubble(r0), _pipeline_bubble(r1)
    busy = sum(b - a for rep, s, ins, a, b in r0.raw.records if rep == 0 and s == "compute" and ins.phase != "optim")
    assert b0 == pytest.approx(3 / 8, rel=0.05)
    assert 2 * 3 * cm.p2p_overhead / busy < b1 - b0 < 2 * (3 + 8) * cm.p2p_overhead / busy


def test_deeper_interleaving_raises_throughput_on_uniform_stages():
    """pp=4 with TP over sequence-parallel sends: each extra chunk per stage shortens the bubble."""
    spec = models.gpt(32, 8192, 64, vocab=1024, seq_len=2048, name="deep", pad_vocab=128)
    tps = []
    for v in (1, 2, 4):
        s = Strategy.parse(f"tp=8,pp=4,sp{',vpp=%d' % v if v > 1 else ''}")
        tps.append(simulate(compile(spec, s, global_batch=16, seq_len=2048), "a100-4x8").tokens_per_s)
    assert tps[0] < tps[1] < tps[2], tps
