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


def _stage_bubbles(r) -> list[float]:
    """Per stage, idle over busy time within the stage's own span (its first model compute to its last),
    the papers' definition (Qi et al. 2024: a stage's cost, the makespan of its own work; the optimizer
    step after the flush is neither busy nor idle pipeline time). A zero-bubble stage may start late and
    end late: the next step's start overlaps it once the optimizer's synchronisation is post-validated."""
    spans: dict[int, list[float]] = {}
    for rep, s, ins, a, b in r.raw.records:
        if s == "compute" and ins.phase != "optim":
            lo, hi, busy = spans.get(rep, [a, b, 0.0])
            spans[rep] = [min(lo, a), max(hi, b), busy + b - a]
    return [(hi - lo - busy) / busy for lo, hi, busy in spans.values()]


def _free_transfers(cm: CostModel) -> CostModel:
    """The formulas' assumption: pipeline sends cost nothing."""
    return dataclasses.replace(cm, p2p_overhead=0.0, comm_overhead=0.0, step_p2p_posted=True,
                               latency={k: 0.0 for k in cm.latency}, bandwidth={k: 1e18 for k in cm.bandwidth})


def _ideal(cm: CostModel) -> CostModel:
    """The papers' idealized setting: free transfers and F = I = W (FLOPs pricing at one efficiency: a
    split backward's halves each take a forward's time)."""
    return dataclasses.replace(_free_transfers(cm), compute_model="flops", hbm_bw=1e30, attention_score_bytes=0.0,
                               region_floor={k: 0.0 for k in cm.region_floor})


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


#: (pp, m) pairs every formula is checked on
_PM = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]


_SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zb-h1", 1), ("zb-2p", 1),
              ("zb-v", 2)]


@pytest.mark.parametrize("name,vpp,pp,m", [(n, v, p, m) for n, v in _SCHEDULES for p, m in _PM
                                            if v * p <= UNI.layers])        # each chunk holds a layer
def test_simulated_bubble_equals_the_published_formula(name, vpp, pp, m):
    """The largest stage bubble on uniform stages (no embedding or head: a vocabulary of 128) with free
    transfers and F = I = W planned: (p-1)/m (1F1B, GPipe), (p-1)/(v m) (interleaved), (p-1)(F+I-W)/(m(F+I+W))
    = (p-1)/(3m) (ZB-1p, here zb-h1), 0 (ZB-2p, ZB-V: the zero-bubble paper's table at T_F = T_B = T_W)."""
    s = Strategy(pp=pp, vpp=vpp, schedule=name)
    cost = _ideal(CostModel.for_cluster(cluster.get("a100-1x8")))
    r = simulate(compile(UNI, s, global_batch=m, seq_len=2048, costs=S.ScheduleCosts.unit(s.stages)), "a100-1x8", cost)
    f, i, w = _phase_times(r)
    assert i == pytest.approx(f, rel=1e-3) and w == pytest.approx(f, rel=1e-3)
    want = S.get_schedule(s.schedule).bubble(s.pp, m, s.vpp, 1.0, 1.0, 1.0)
    assert max(_stage_bubbles(r)) == pytest.approx(want, rel=0.02, abs=0.001)


@pytest.mark.parametrize("strategy,m", [("pp=4", 8), ("pp=4,vpp=2", 8), ("pp=2,vpp=4", 8), ("pp=4,schedule=zb-h1", 8),
                                        ("pp=2,schedule=zb-h1", 8)])
def test_simulated_bubble_follows_the_formula_at_the_simulated_phase_times(strategy, m):
    """The formulas at the F, I, W the kernel shapes give each phase (unequal halves of a backward), with
    the schedule planned on the compile's own duration estimate."""
    s = Strategy.parse(strategy)
    cost = _free_transfers(CostModel.for_cluster(cluster.get("a100-1x8")))
    r = simulate(compile(UNI, s, global_batch=m, seq_len=2048), "a100-1x8", cost)
    want = S.get_schedule(s.schedule).bubble(s.pp, m, s.vpp, *_phase_times(r))
    assert max(_stage_bubbles(r)) == pytest.approx(want, rel=0.05, abs=0.002)


@pytest.mark.parametrize("pp,m", _PM)
def test_dualpipev_bubble_stays_within_its_formula(pp, m):
    """DualPipeV's (PP/2-1)(F&B+B-3W) is its handcrafted order's (full backwards in the main phase); the
    list-scheduled recipe splits every backward, so W fills more idle time: at most the formula, and below
    ZB-1p's (p-1)/(3m) per chunk-pair of the same stages."""
    s = Strategy(pp=pp, vpp=2, schedule="dualpipev")
    cost = _ideal(CostModel.for_cluster(cluster.get("a100-1x8")))
    r = simulate(compile(UNI, s, global_batch=m, seq_len=2048, costs=S.ScheduleCosts.unit(s.stages)), "a100-1x8", cost)
    want = S.get_schedule("dualpipev").bubble(pp, m, 2, 1.0, 1.0, 1.0)
    assert 0 < max(_stage_bubbles(r)) <= want * 1.02 + 0.001


@pytest.mark.parametrize("name,vpp", [("zb-2p", 1), ("zb-v", 2)])
def test_zero_bubble_schedules_beat_zb_h1_on_uniform_stages(name, vpp):
    """Planned with the compile's own duration estimate (not unit costs), on free transfers. One step's
    time falls with ZB-V's shorter warm-up; ZB-2p's stages start and end (p-1)F apart, which only the
    next step's overlap (the paper's post-validated optimizer, not simulated) recovers: no slower."""
    cost = _ideal(CostModel.for_cluster(cluster.get("a100-1x8")))
    zb1 = simulate(compile(UNI, "pp=4,schedule=zb-h1", global_batch=16, seq_len=2048), "a100-1x8", cost)
    other = simulate(compile(UNI, f"pp=4,vpp={vpp},schedule={name}", global_batch=16, seq_len=2048), "a100-1x8", cost)
    assert max(_stage_bubbles(other)) < max(_stage_bubbles(zb1)) / 2
    assert other.step_time < zb1.step_time if name == "zb-v" else other.step_time <= zb1.step_time * (1 + 1e-9)


def test_pipeline_sends_cost_their_path():
    """A pipeline send costs its link's latency plus bytes over bandwidth (NVLink here), nothing fitted: in
    1F1B the bubble exceeds the formula by about the 2(p-1) sends of warm-up and cool-down, over a stage's
    busy time, and at most by one round trip per micro-batch on top."""
    cm = CostModel.for_cluster(cluster.get("a100-1x8"))
    assert cm.p2p_overhead == 0.0
    free = _free_transfers(cm)
    paid = dataclasses.replace(free, latency=cm.latency, bandwidth=cm.bandwidth, comm_overhead=cm.comm_overhead)
    prog = compile(UNI, "pp=4", global_batch=8, seq_len=2048)
    r0, r1 = simulate(prog, "a100-1x8", free), simulate(prog, "a100-1x8", paid)
    send = next(i for i in prog.ranks[0].instrs() if i.op == "send")
    t_send = cm.op_overhead("send") + cm.latency["intra"] + send.nbytes / cm.op_bw("send", "intra")
    assert 1e-5 < t_send < 1e-3              # an activation of 16 MiB over NVLink: tens of microseconds
    b0, b1 = max(_stage_bubbles(r0)), max(_stage_bubbles(r1))
    busy = sum(b - a for rep, s, ins, a, b in r0.raw.records if rep == 0 and s == "compute" and ins.phase != "optim")
    assert b0 == pytest.approx(3 / 8, rel=0.02)
    assert 2 * 3 * t_send / busy * 0.9 < b1 - b0 < 2 * (3 + 8) * t_send / busy


def test_deeper_interleaving_raises_throughput_on_uniform_stages():
    """pp=4 with TP over sequence-parallel sends: each extra chunk per stage shortens the bubble."""
    spec = models.gpt(32, 8192, 64, vocab=1024, seq_len=2048, name="deep", pad_vocab=128)
    tps = []
    for v in (1, 2, 4):
        s = Strategy.parse(f"tp=8,pp=4,sp{',vpp=%d' % v if v > 1 else ''}")
        tps.append(simulate(compile(spec, s, global_batch=16, seq_len=2048), "a100-4x8").tokens_per_s)
    assert tps[0] < tps[1] < tps[2], tps


def test_a_fixed_chunk_count_and_a_published_alias_parse():
    """``schedule=zb-v`` alone means its two chunks per stage; ``zb-1p`` (the paper's name) is zb-h1."""
    assert Strategy.parse("pp=4,schedule=zb-v").vpp == 2 and Strategy.parse("pp=4,schedule=dualpipev").vpp == 2
    assert Strategy.parse("pp=4,schedule=zb-2p").vpp == 1
    s = Strategy.parse("pp=4,schedule=zb-1p")
    assert s.schedule == "zb-h1" and str(s) == str(Strategy.parse("pp=4,schedule=zb-h1"))
    assert "zb-1p" not in S.schedule_names()
    with pytest.raises(StrategyError, match="exactly 2 chunks per stage"):
        Strategy.parse("pp=4,vpp=1,schedule=zb-v")
