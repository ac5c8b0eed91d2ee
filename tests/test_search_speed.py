"""The search's speed-ups (shared schedule orders and replays in the bounds, the evaluator's
paused garbage collector) never change what it finds."""
import math

import numpy as np
import pytest

from parashift import models, search
from parashift.ir.compile import planning_costs
from parashift.ir.schedules import schedule_steps
from parashift.search import bounds
from parashift.search.bounds import _replay_unit, replay

SETTING = ("gpt3-1.3b", "a100-1x8", 8, 32, 2048)  # model, cluster, devices, global batch, seq len


def _strategies() -> list:
    m, c, d, b, s = SETTING
    pts = search.make_space(m, c, devices=d, global_batch=b, seq_len=s).enumerate()
    by_schedule: dict = {}
    for p in pts:  # a few strategies of every schedule, sharing (schedule, pp, vpp, m) across dp/tp/zero
        by_schedule.setdefault(p.schedule, []).append(p)
    picked = [p for v in by_schedule.values() for p in v[:: max(1, len(v) // 4)][:4]]
    assert len({p.schedule for p in picked}) >= 3
    return picked


def _cold() -> None:
    bounds._STEPS.clear()
    bounds._REPLAYS.clear()
    _replay_unit.cache_clear()


def _same(a: search.Outcome, b: search.Outcome) -> bool:
    da, db = a.to_dict(), b.to_dict()
    da.pop("seconds"), db.pop("seconds")
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in
               zip(da.values(), db.values())) and da.keys() == db.keys()


def test_cached_schedule_orders_equal_fresh_ones():
    m, c, d, b, s = SETTING
    for p in _strategies():
        n = p.num_microbatches(b)
        assert bounds._steps(models.get(m), p, n, s)[1] == schedule_steps(p, n, planning_costs(models.get(m), p, s)), str(p)


def test_outcomes_and_bounds_identical_with_and_without_the_caches():
    """Every strategy scored cold (caches emptied before it) and warm (after all the others
    filled them, in reverse order) gets the same outcome, bound and memory bound."""
    m, c, d, b, seq = SETTING
    ev = search.SimEvaluator(m, c, global_batch=b, seq_len=seq)
    pts = _strategies()
    cold = {}
    for p in pts:
        _cold()
        cold[str(p)] = (ev(p), ev.throughput_bound(p), ev.could_fit(p),
                        bounds.peak_memory_lower_bound(ev.model, p, global_batch=b, seq_len=seq))
    assert any(o.simulated for o, *_ in cold.values()), "the test must simulate some strategies"
    for p in reversed(pts):
        warm = (ev(p), ev.throughput_bound(p), ev.could_fit(p),
                bounds.peak_memory_lower_bound(ev.model, p, global_batch=b, seq_len=seq))
        ref = cold[str(p)]
        assert _same(warm[0], ref[0]), str(p)
        assert warm[1:] == ref[1:], str(p)
    assert len(bounds._STEPS) < len(pts)  # strategies did share orders
    assert len(bounds._REPLAYS) <= len(pts)


def test_replay_matches_an_uncached_order():
    """The replay over the shared order equals one over a freshly planned order."""
    m, c, d, b, seq = SETTING
    ev = search.SimEvaluator(m, c, global_batch=b, seq_len=seq)
    for p in _strategies():
        t, peak = replay(ev.model, p, global_batch=b, seq_len=seq, rate=1.0)
        _cold()
        t2, peak2 = replay(ev.model, p, global_batch=b, seq_len=seq, rate=1.0)
        assert t == pytest.approx(t2, rel=0, abs=0) and np.array_equal(peak, peak2), str(p)


def test_evaluation_restores_the_garbage_collector():
    import gc
    m, c, d, b, seq = SETTING
    ev = search.SimEvaluator(m, c, global_batch=b, seq_len=seq, precheck=False)
    p = _strategies()[0]
    assert gc.isenabled()
    ev(p)
    assert gc.isenabled()
    gc.disable()
    try:
        ev(p)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
