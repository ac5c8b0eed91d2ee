"""The strategy space: enumeration against brute force, canonical forms, the memory lower bound."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import StrategyError, cluster as clusters, models, search, vps
from parashift.strategy import RECOMPUTE, SCHEDULES, Strategy


def brute_force(model, cl, devices, global_batch, *, mbs=(1, 2, 4, 8), vpp=(2, 4), zero=(0, 1, 2, 3),
                schedules=SCHEDULES, recompute=RECOMPUTE, switches=()):
    """Every field combination (each of the bare keys ``switches`` on and off too), kept when Strategy
    accepts it and it runs; folded to canonical form."""
    out = set()
    ints = range(1, devices + 1)
    eps = [e for e in ints if model.experts and model.experts % e == 0] if model.is_moe else [1]
    for dp, tp, pp in itertools.product(ints, ints, ints):
        if dp * tp * pp != devices:
            continue
        for ep, z, m, sc, v, rc, *on in itertools.product(eps, zero, mbs, schedules, (1,) + tuple(vpp), recompute,
                                                          *[(False, True)] * len(switches)):
            if global_batch % m:
                continue
            if sc == "dualpipev" and v != 2 or sc == "interleaved-1f1b" and v not in vpp:
                continue
            try:
                s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=z, vpp=v, mbs=m, schedule=sc, recompute=rc,
                             **dict(zip(switches, on)))
                s.num_microbatches(global_batch)
            except StrategyError:
                continue
            if s.problems(model, devices) or tp > cl.per_node:
                continue
            if pp == 1:
                s = s.replace(schedule="1f1b", vpp=1)
            if dp == 1:
                s = s.replace(zero=0, overlap_param=False)
            out.add(str(s))
    return out


@pytest.mark.parametrize("model,cluster,devices,batch", [
    ("tiny-gpt", "cpu-local", 4, 16),
    ("tiny-moe", "cpu-local", 8, 16),
    ("tiny-gpt", "h100-2x4", 6, 12),
    ("llama2-13b", "a800-2x8", 12, 48),
])
def test_enumeration_equals_brute_force(model, cluster, devices, batch):
    m, cl = models.get(model), clusters.get(cluster)
    got = search.enumerate_space(m, cl, devices=devices, global_batch=batch, seq_len=m.seq_len)
    assert len({str(s) for s in got}) == len(got), "enumeration lists a strategy twice"
    assert {str(s) for s in got} == brute_force(m, cl, devices, batch)
    assert all(s.world == devices for s in got)


def test_enumeration_with_the_bare_keys_equals_brute_force():
    """sp, overlap_param, tp_async and grad_fusion offered on and off: the enumeration is every
    combination Strategy accepts (sp and tp_async only with tp > 1), folded as brute force folds it."""
    m, cl = models.get("tiny-gpt"), clusters.get("cpu-local")
    keys = ("sp", "overlap_param", "tp_async", "grad_fusion")
    axes = dict(mbs=(1, 2), schedules=("1f1b", "interleaved-1f1b"), vpp=(2,), recompute=("none", "full"))
    got = search.enumerate_space(m, cl, devices=4, global_batch=16, seq_len=m.seq_len,
                                 **{k: (False, True) for k in keys}, **axes)
    assert len({str(s) for s in got}) == len(got), "enumeration lists a strategy twice"
    assert {str(s) for s in got} == brute_force(m, cl, 4, 16, switches=keys, **axes)
    assert all(s.tp > 1 for s in got if s.tp_async or s.sp) and any(s.tp_async and s.sp for s in got)
    assert any(s.grad_fusion and s.tp == 1 for s in got)


def test_space_axes_for_a_dense_and_a_moe_model():
    sp = search.make_space("llama2-13b", "a800-16x8", devices=64, global_batch=512, seq_len=4096)
    assert sp.tp == (1, 2, 4, 8)            # tp=5 would divide the heads but not the FFN (13824)
    assert sp.pp == (1, 2, 4, 8, 16, 32)    # pp=64 exceeds the 40 layers
    assert sp.ep == (1,)
    moe = search.make_space("qwen1.5-moe-a2.7b", "a800-16x8", devices=64, global_batch=256, seq_len=4096)
    assert moe.ep == (1, 2, 4)              # the divisors of 64 that divide 60 experts
    with pytest.raises(StrategyError, match="a800-2x4"):
        search.make_space("tiny-gpt", "a800-1x4", devices=8, global_batch=8, seq_len=32)


def test_build_reports_why_a_point_is_invalid():
    sp = search.make_space("tiny-gpt", "cpu-local", devices=6, global_batch=12, seq_len=32)
    s, why = sp.build({"tp": 2, "pp": 4, "zero": 0, "mbs": 1, "schedule": "1f1b", "recompute": "none"})
    assert s is None and "does not divide the 6 devices" in why
    s, why = sp.build({"tp": 1, "pp": 1, "zero": 1, "mbs": 4, "schedule": "1f1b", "recompute": "none"})
    assert s is None and "not divisible by dp*mbs=24" in why
    s, why = sp.build({"tp": 2, "pp": 3, "zero": 2, "mbs": 1, "schedule": "gpipe", "recompute": "full"})
    assert why == "" and str(s) == "dp=1,tp=2,pp=3,schedule=gpipe,recompute=full"  # dp=1: zero folds to 0
    s, why = sp.build({"tp": 1, "pp": 1, "zero": 3, "mbs": 2, "schedule": "interleaved-1f1b", "vpp": 2,
                       "recompute": "none"})
    assert why == "" and str(s) == "dp=6,tp=1,pp=1,zero=3,mbs=2"


def test_canonical_folds_equivalent_strategies():
    assert str(search.canonical(Strategy.parse("dp=1,tp=2,pp=1,zero=2,schedule=gpipe"))) == "dp=1,tp=2,pp=1"
    s = Strategy.parse("dp=2,pp=2,vpp=2,zero=1")
    assert search.canonical(s) == s
    assert search.canonical(search.canonical(Strategy.parse("dp=1,pp=1,vpp=2"))) == Strategy()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["tiny-gpt", "tiny-moe", "gpt3-1.3b"]), st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (1, 4)]),
       st.sampled_from([1, 2, 4]), st.integers(0, 3), st.sampled_from([1, 2]), st.booleans(), st.booleans())
def test_memory_bound_never_exceeds_the_layout(model, tp_pp, dp, zero, vpp, moe_ep, hybrid):
    m = models.get(model)
    tp, pp = tp_pp
    if m.heads % tp or m.kv_heads % tp or pp * vpp > m.layers:
        return
    ep = dp if (m.is_moe and moe_ep and m.experts % dp == 0) else 1
    s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, vpp=vpp,
                 schedule="interleaved-1f1b" if vpp > 1 else "1f1b",
                 shard=dp // 2 if hybrid and zero == 1 and ep == 1 and dp > 1 else 0)
    if s.problems(m):
        return
    bound = search.state_bytes_per_stage(m, s)
    held = vps.layout(m, s).bytes_per_rank()
    stage = s.coords(np.arange(s.world))["pp"]
    per_stage = np.array([held[stage == p].max() for p in range(pp)])
    assert np.all(bound <= per_stage)
    if zero == 0:  # nothing is sharded over DP: the bound is exact
        assert np.array_equal(bound.astype(np.int64), per_stage)
    else:          # flooring the ZeRO shards loses at most a few elements per tensor
        assert np.all(per_stage - bound <= 16 * len(m.tensors) * dp)


def test_memory_bound_rejects_70b_on_one_node():
    m = models.get("llama2-70b")
    assert search.state_bytes_lower_bound(m, Strategy(dp=1, tp=8, pp=1)) > 80 * 2**30
    assert search.state_bytes_lower_bound(m, Strategy(dp=1, tp=8, pp=4, zero=1)) < 40 * 2**30


def test_neighbors_change_one_axis_or_trade_two_sizes():
    sp = search.make_space("llama2-13b", "a800-16x8", devices=64, global_batch=256, seq_len=4096)
    s = Strategy.parse("dp=32,tp=2,pp=1,zero=1,mbs=2,recompute=selective")
    seen = {str(s)}
    found = []
    while (p := search.neighbor(sp, s, seen)) is not None:
        n, why = sp.build(p)
        assert why == "" and str(n) not in seen
        seen.add(str(n))
        found.append(n)
    names = {str(n) for n in found}
    assert "dp=32,tp=1,pp=2,zero=1,mbs=2,recompute=selective" in names      # tp and pp traded
    assert "dp=64,tp=1,pp=1,zero=1,mbs=2,recompute=selective" in names      # tp and dp traded
    assert "dp=32,tp=2,pp=1,zero=3,mbs=2,recompute=selective" in names      # one axis
    fields = ("dp", "tp", "pp", "zero", "mbs", "recompute", "schedule", "vpp", "ep")
    for n in found:  # one axis changed, or the schedule with its vpp, or sizes traded
        diff = {f for f in fields if getattr(n, f) != getattr(s, f)} - ({"zero"} if n.dp == 1 else set())
        assert len(diff) == 1 or diff <= {"schedule", "vpp"} or (diff <= {"dp", "tp", "pp"} and len(diff) == 2)
    # with a bound, only neighbors that could beat the incumbent, best bound first
    bound = {str(n): float(i) for i, n in enumerate(found)}
    best = search.neighbor(sp, s, {str(s)}, bound=lambda m: bound[str(m)], beat=len(found) - 3)
    assert sp.build(best)[0] == found[-1]
    assert search.neighbor(sp, s, {str(s)}, bound=lambda m: bound[str(m)], beat=len(found)) is None


def test_sp_and_cp_axes():
    """cp and sp are axes when offered: dp follows from tp*pp*cp, sp only with tp > 1, cp only where
    the sequence splits into 2*cp balanced chunks; optuna points and params_of round-trip them."""
    from parashift.search.space import make_space, params_of
    space = make_space("tiny-gpt", "a100-1x8", devices=8, global_batch=8, seq_len=32, pp=(1,), mbs=(1,),
                       zero=(0, 1), recompute=("none",), schedules=("1f1b",), cp=(1, 2, 4, 32), sp=(False, True))
    found = space.enumerate()
    assert {s.cp for s in found} == {1, 2, 4}                        # 32 does not split seq_len=32 in 64
    assert all(s.world == 8 and (not s.sp or s.tp > 1) for s in found)
    assert any(s.sp and s.cp == 2 for s in found) and any(s.cp == 4 and s.zero == 1 for s in found)
    for s in found:
        p = params_of(space, s)
        assert p is not None and space.build(p)[0] == s
    assert space.describe()["cp"] == [1, 2, 4, 32] and space.describe()["sp"] == [False, True]


def test_overlap_param_axis():
    """overlap_param is an axis when offered: only with zero 1 or 2 and a DP group to gather over
    (folded away elsewhere); points round-trip; a neighbor turns it on and off."""
    from parashift.search.space import canonical, make_space, neighbor, params_of
    space = make_space("tiny-gpt", "a100-1x8", devices=4, global_batch=8, seq_len=32, pp=(1, 2), mbs=(1,),
                       recompute=("none",), schedules=("1f1b",), overlap_param=(False, True))
    found = space.enumerate()
    on = [s for s in found if s.overlap_param]
    assert on and all(s.zero in (1, 2) and s.dp > 1 for s in on)
    assert {str(s.replace(overlap_param=False)) for s in on} <= {str(s) for s in found}
    for s in found:
        p = params_of(space, s)
        assert p is not None and space.build(p)[0] == s
    assert canonical(Strategy(dp=1, tp=4, zero=1, overlap_param=True)) == Strategy(tp=4)
    s, target = Strategy(dp=4, zero=1), Strategy(dp=4, zero=1, overlap_param=True)
    visited = {str(x) for x in found if x != target}
    assert space.build(neighbor(space, s, visited))[0] == target      # one axis away
    assert any(params_of(space, Strategy(dp=4, zero=z, overlap_param=True)) for z in (1, 2))
    assert space.describe()["overlap_param"] == [False, True]
    assert make_space("tiny-gpt", "a100-1x8", devices=4, global_batch=8, seq_len=32).overlap_param == (False,)


def test_tp_async_and_grad_fusion_axes():
    """tp_async and grad_fusion are axes when offered: tp_async only with tp > 1 (a tp=1 point drops it, an
    optuna trial never gets it there, a tp -> 1 neighbor turns it off), grad_fusion anywhere; points
    round-trip; describe() lists both; off (one choice, no optuna parameter) unless offered."""
    import optuna
    from parashift.search.space import make_space, neighbor, params_of
    space = make_space("tiny-gpt", "a100-1x8", devices=4, global_batch=8, seq_len=32, pp=(1, 2), mbs=(1,),
                       recompute=("none",), schedules=("1f1b",), zero=(0,), tp_async=(False, True),
                       grad_fusion=(False, True))
    found = space.enumerate()
    assert not any(s.tp_async and s.tp == 1 for s in found)
    plain = {str(s) for s in found if not s.tp_async and not s.grad_fusion}
    for s in found:   # each layout with every combination it admits
        assert str(s.replace(tp_async=False, grad_fusion=False)) in plain
        for ta, gf in itertools.product((False, True) if s.tp > 1 else (False,), (False, True)):
            assert s.replace(tp_async=ta, grad_fusion=gf) in found
        p = params_of(space, s)
        assert p is not None and space.build(p)[0] == s
    assert space.build({"tp": 1, "pp": 1, "zero": 0, "mbs": 1, "schedule": "1f1b", "recompute": "none",
                        "tp_async": True})[0] == Strategy(dp=4)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    built = []
    for _ in range(40):
        trial = study.ask()
        s, _ = space.build(space.suggest(trial))
        study.tell(trial, 0.0)
        built.append(s)
    assert {"tp_async", "grad_fusion"} <= set(study.trials[0].params)
    assert all(s is not None and not (s.tp_async and s.tp == 1) for s in built)
    assert any(s.tp_async for s in built) and any(s.grad_fusion for s in built)
    s = Strategy(dp=2, tp=2, tp_async=True)
    visited = {str(x) for x in found if x != Strategy(dp=4)}
    assert space.build(neighbor(space, s, visited))[0] == Strategy(dp=4)     # tp traded with dp: tp_async off
    assert space.describe()["tp_async"] == [False, True] and space.describe()["grad_fusion"] == [False, True]
    off = make_space("tiny-gpt", "a100-1x8", devices=4, global_batch=8, seq_len=32, mbs=(1,), recompute=("none",))
    assert off.tp_async == off.grad_fusion == (False,)
    trial = optuna.create_study().ask()
    off.suggest(trial)
    assert not {"tp_async", "grad_fusion"} & set(trial.params)
