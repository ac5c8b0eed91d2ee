"""Trace-aware planning: segment extraction, the switch accounting, the optimal DP, the dip test."""
import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, TraceFormatError, search
from parashift.search import IDLE, Outcome, SwitchCost, best_path, greedy_path, run_path


# ---- accounting and the dynamic program ------------------------------------------------------------------
def test_run_path_charges_switches_and_carries_them_over():
    start, end = np.array([0.0, 100.0, 110.0]), np.array([100.0, 110.0, 200.0])
    r = run_path(start, end, [0, 1, 0], [10.0, 5.0], lambda a, b: 20.0)
    # B's switch runs 100..120, past its 10 s segment; the switch back queues behind it: 120..140
    assert r.switch_seconds.tolist() == [0.0, 20.0, 20.0]
    assert r.lost_seconds.tolist() == [0.0, 10.0, 30.0]
    assert r.tokens.tolist() == [1000.0, 0.0, 600.0]
    assert r.switches == 2 and r.total_lost == 40.0


def test_idle_segments_and_resuming():
    start, end = np.array([0.0, 10.0, 20.0, 30.0]), np.array([10.0, 20.0, 30.0, 40.0])
    cost = lambda a, b: 4.0 if a == IDLE else 1.0  # noqa: E731
    r = run_path(start, end, [IDLE, 0, IDLE, 0], [2.0], cost)
    assert r.switch_seconds.tolist() == [0.0, 0.0, 0.0, 4.0]   # the first start is free; a resume is not
    assert r.idle_seconds.tolist() == [10.0, 0.0, 10.0, 0.0]
    assert r.tokens.tolist() == [0.0, 20.0, 0.0, 12.0] and r.switches == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.data())
def test_best_path_is_optimal_against_brute_force(n, data):
    k = 3
    dur = np.array(data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n)), dtype=float)
    end = np.cumsum(dur)
    start = end - dur
    tps = data.draw(st.lists(st.integers(1, 9), min_size=k, max_size=k))
    costs = np.array(data.draw(st.lists(st.integers(0, 40), min_size=(k + 1) * k, max_size=(k + 1) * k)),
                     dtype=float).reshape(k + 1, k)
    cost = lambda a, b: costs[k if a == IDLE else a, b]  # noqa: E731
    options = [sorted(data.draw(st.sets(st.integers(0, k - 1), max_size=k))) for _ in range(n)]
    best = run_path(start, end, best_path(start, end, options, tps, cost), tps, cost).total_tokens
    brute = max(run_path(start, end, list(p), tps, cost).total_tokens
                for p in itertools.product(*[o or [IDLE] for o in options]))
    assert best == pytest.approx(brute)
    assert best >= run_path(start, end, greedy_path(options, tps), tps, cost).total_tokens - 1e-9


# ---- segments ---------------------------------------------------------------------------------------------
def test_segments_of_a_normalized_trace_in_nodes():
    tr = pd.DataFrame({"time": [60.0, 120.0, 180.0, 240.0], "event": ["preempt", "add", "add", "preempt"],
                       "count": [1, 1, 2, 2], "available": [3, 4, 6, 4], "notice": [30.0, np.nan, np.nan, 30.0]})
    tr.attrs.update(initial=4, duration=300.0)
    seg = search.trace_segments(tr, per_node=8, max_devices=40)
    assert seg["start"].tolist() == [0.0, 60.0, 120.0, 180.0, 240.0]
    assert seg["end"].tolist() == [60.0, 120.0, 180.0, 240.0, 300.0]
    assert seg["devices"].tolist() == [32, 24, 32, 40, 32]   # 6 nodes x 8 = 48, clipped to 40
    seg = search.trace_segments(tr, devices_per_node=2)
    assert seg["devices"].tolist() == [8, 6, 8, 12, 8]


def test_segments_of_a_hand_built_curve_merge_repeats():
    tr = pd.DataFrame({"time": [0, 10, 20, 30, 50], "devices": [4, 4, 2, 4, 4]})
    seg = search.trace_segments(tr)
    assert seg[["start", "end", "devices"]].values.tolist() == [[0, 20, 4], [20, 30, 2], [30, 50, 4]]
    seg = search.trace_segments(tr, end=80)
    assert seg["end"].iloc[-1] == 80 and seg["duration"].sum() == 80
    with pytest.raises(TraceFormatError, match="sort"):
        search.trace_segments(pd.DataFrame({"time": [0, 20, 10], "devices": [1, 2, 3]}))
    with pytest.raises(TraceFormatError, match="devices"):
        search.trace_segments(pd.DataFrame({"time": [0, 1], "gpus": [1, 2]}))


# ---- the dip test with table-driven stand-ins ---------------------------------------------------------------
A, B, C = (Strategy.parse("dp=16"), Strategy.parse("dp=4,pp=3"), Strategy.parse("dp=12"))
TPS = {str(A): 100.0, str(B): 97.0, str(C): 99.0}


def table_eval(s):
    """Only A (16 devices), B and C (12 devices) run; C is the best on 12 devices, A on 16."""
    t = TPS.get(str(s))
    if t is None:
        return Outcome("infeasible", "not in the table", peak_memory=1e12, simulated=True)
    return Outcome("ok", "", 1.0 / t, t, 1e9, simulated=True)


def test_switch_aware_rides_out_a_short_dip_and_trains_more_than_greedy():
    trace = pd.DataFrame({"time": [0, 1000, 1020, 2020], "devices": [16, 12, 16, 16]})
    calls = []

    def hot(src, dst):
        calls.append((str(src), str(dst)))
        return SwitchCost(50.0, "table")

    plan = search.plan_trace(trace, "llama2-13b", "a800-2x8", global_batch=48, seq_len=4096, evaluate=table_eval,
                             switch_cost=hot, restart_cost=lambda a, b: SwitchCost(300.0, "table"),
                             space_options={"schedules": ("1f1b",), "zero": (0,), "mbs": (1,),
                                            "recompute": ("none",)})
    assert plan.per_count.set_index("devices").loc[16, "strategy"] == str(A)
    assert plan.per_count.set_index("devices").loc[12, "strategy"] == str(C)
    aware, greedy = plan.policy_frame("switch-aware"), plan.policy_frame("hot-switch")
    assert greedy["strategy"].tolist() == [str(A), str(C), str(A)]
    assert aware["strategy"].nunique() == 1 and aware["strategy"].iloc[0] == str(C)  # kept through the dip
    s = plan.summary()
    assert s.loc["switch-aware", "switches"] == 0 and s.loc["hot-switch", "switches"] == 2
    assert s.loc["switch-aware", "tokens"] == pytest.approx(2020 * 99.0)
    assert s.loc["hot-switch", "tokens"] == pytest.approx(1000 * 100.0 + 0 + (1000 - 30 - 50) * 100.0)
    assert s.loc["switch-aware", "tokens"] > s.loc["hot-switch", "tokens"] > s.loc["checkpoint-restart", "tokens"]
    assert s.loc["hot-switch", "lost_seconds"] == pytest.approx(100.0)
    # the same trace with long high periods: switching is worth it, and the plan switches
    long = pd.DataFrame({"time": [0, 100000, 100020, 200020], "devices": [16, 12, 16, 16]})
    plan = search.plan_trace(long, "llama2-13b", "a800-2x8", global_batch=48, seq_len=4096, evaluate=table_eval,
                             switch_cost=hot, restart_cost=lambda a, b: SwitchCost(300.0, "table"),
                             space_options={"schedules": ("1f1b",), "zero": (0,), "mbs": (1,),
                                            "recompute": ("none",)})
    assert plan.policy_frame("switch-aware")["strategy"].iloc[0] == str(A)


def test_trace_plan_tables_and_plot(tmp_path):
    trace = pd.DataFrame({"time": [0, 600, 700, 1800], "devices": [16, 12, 16, 16]})
    plan = search.plan_trace(trace, "llama2-13b", "a800-2x8", global_batch=48, seq_len=4096, evaluate=table_eval,
                             switch_cost=lambda a, b: SwitchCost(5.0, "table"),
                             restart_cost=lambda a, b: SwitchCost(90.0, "table"),
                             space_options={"schedules": ("1f1b",), "zero": (0,), "mbs": (1,),
                                            "recompute": ("none",)})
    df = plan.to_frame()
    assert set(df["policy"]) == set(search.POLICIES) and len(df) == 3 * len(plan.segments)
    assert list(plan.transitions["src_devices"]) == [16, 12]
    assert plan.transitions["switch_seconds"].tolist() == [5.0, 5.0]
    assert plan.transitions["restart_seconds"].tolist() == [90.0, 90.0]
    for p in search.POLICIES:  # the cumulative curve ends at the policy's total
        t, y = plan.cumulative_tokens(p)
        assert y[-1] == pytest.approx(plan.summary().loc[p, "tokens"]) and np.all(np.diff(y) >= 0)
    d = plan.to_dict()
    assert set(d["policies"]) == set(search.POLICIES)
    plan.plot(str(tmp_path / "trace.png"))
    assert (tmp_path / "trace.png").stat().st_size > 10_000


# ---- the dip test with the real simulator and transition engine -----------------------------------------------
REAL = dict(global_batch=32, seq_len=2048, top_k=1,
            space_options={"schedules": ("1f1b",), "zero": (1,), "mbs": (1,), "recompute": ("none",)})


def _real_plan(times, devices):
    return search.plan_trace(pd.DataFrame({"time": times, "devices": devices}), "gpt3-1.3b", "a100-2x8", **REAL)


def test_real_switch_aware_keeps_its_strategy_through_short_changes():
    base = _real_plan([0, 1000, 1001, 2000], [16, 8, 16, 16])
    sw = float(base.transitions["switch_seconds"].max())   # the simulated hot switch between the bests
    assert base.transitions["method"].eq("simulated switch program").all() and sw > 0
    assert (base.transitions["restart_seconds"] > 10 * sw).all()
    best8 = base.per_count.set_index("devices").loc[8, "strategy"]
    # a spike of extra devices lasting half a switch: hot switching up and back down does not pay
    spike = _real_plan([0, 100 * sw, 100.5 * sw, 200 * sw], [8, 16, 8, 8])
    aware, greedy = spike.policy_frame("switch-aware"), spike.policy_frame("hot-switch")
    assert aware["strategy"].eq(best8).all() and greedy["strategy"].nunique() == 2
    s = spike.summary()
    assert s.loc["switch-aware", "switches"] == 0 and s.loc["hot-switch", "switches"] == 2
    assert s.loc["switch-aware", "tokens"] > s.loc["hot-switch", "tokens"]
    # a dip to 8 devices shorter than the switches it would take, between stretches on 16 devices
    # too short for the faster 16-device strategy to make up for switching: the plan runs a
    # strategy that fits the dip from the start and keeps it, where greedy switches twice
    tps = base.per_count.set_index("devices")["tokens_per_s"]
    tr = base.transitions.set_index(["src_devices", "dst_devices"])["switch_seconds"]
    down, up = float(tr.loc[(16, 8)]), float(tr.loc[(8, 16)])
    gain = tps[16] / tps[8] - 1.0                     # relative speed-up of 16 devices
    t1, t3 = 0.5 * down / gain, 0.5 * up / gain
    dip = _real_plan([0, t1, t1 + 0.2 * down, t1 + 0.2 * down + t3], [16, 8, 16, 16])
    aware, greedy = dip.policy_frame("switch-aware"), dip.policy_frame("hot-switch")
    assert aware["strategy"].nunique() == 1 and aware["strategy"].iloc[0] == best8
    assert greedy["strategy"].nunique() == 2
    s = dip.summary()
    assert s.loc["switch-aware", "switches"] == 0 and s.loc["hot-switch", "switches"] == 2
    assert s.loc["switch-aware", "tokens"] > s.loc["hot-switch", "tokens"]


def test_a_trace_that_loses_every_device_idles_and_resumes_from_a_checkpoint():
    trace = pd.DataFrame({"time": [0, 10, 110, 120, 220], "devices": [0, 16, 0, 16, 16]})
    plan = search.plan_trace(trace, "llama2-13b", "a800-2x8", global_batch=48, seq_len=4096, evaluate=table_eval,
                             switch_cost=lambda a, b: SwitchCost(5.0, "table"),
                             restart_cost=lambda a, b: SwitchCost(30.0, "table"),
                             space_options={"schedules": ("1f1b",), "zero": (0,), "mbs": (1,),
                                            "recompute": ("none",)})
    for p in search.POLICIES:
        f = plan.policy_frame(p)
        assert [x if isinstance(x, str) else None for x in f["strategy"]] == [None, str(A), None, str(A)]
        assert f["switch_seconds"].tolist() == [0.0, 0.0, 0.0, 30.0]   # the first start is free
        assert f["tokens"].sum() == pytest.approx((100 + 70) * 100.0)
    s = plan.summary()
    assert (s["idle_seconds"] == 20.0).all() and (s["switches"] == 1).all()


def test_hot_switch_cost_simulates_the_placement_a_live_job_uses():
    src, dst = Strategy.parse("dp=2,tp=4,zero=1"), Strategy.parse("tp=8")
    given_ = search.HotSwitchCost("llama2-7b", "a800-1x8", placement="given")(src, dst)
    kept = search.HotSwitchCost("llama2-7b", "a800-1x8")(src, dst)
    assert kept.method == given_.method == "simulated switch program"
    assert kept.bytes_moved < 0.6 * given_.bytes_moved and kept.seconds < given_.seconds


def test_a_trace_too_long_to_plan_is_refused_before_any_search():
    from parashift.errors import LimitError
    n = search.MAX_PATH_STEPS // 25 + 2          # segments x (4 candidates + 1)^2 just over the limit
    t = np.arange(n + 1, dtype=float)
    trace = pd.DataFrame({"time": t, "devices": np.where(np.arange(n + 1) % 2, 16, 12)})
    calls = []

    def never(*a, **k):
        calls.append(a)
        raise AssertionError("searched before refusing")

    with pytest.raises(LimitError, match="over the limit of 50,000,000"):
        search.plan_trace(trace, "llama2-13b", "a800-2x8", global_batch=48, seq_len=4096, evaluate=never)
    assert not calls
    w = search.plan_work(n, 2, 4)
    assert w["path_steps"] == n * 25 > search.MAX_PATH_STEPS
