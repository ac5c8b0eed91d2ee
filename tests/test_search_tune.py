"""The Optuna search with an injected analytic evaluator: optimum, pruning, constraints, storage, Pareto."""
import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from parashift import models, search
from parashift.search import Outcome, SearchError

GIB = 2**30


class Analytic:
    """A deterministic stand-in for the simulator: step time from FLOPs, TP/PP/ZeRO penalties and
    the schedule's bubble; memory from the states bound plus the activations held. Records calls."""

    def __init__(self, model, global_batch, seq_len, memory=80 * GIB):
        self.model, self.gb, self.seq, self.memory = models.get(model), global_batch, seq_len, memory
        self.calls: list[str] = []

    def __call__(self, s):
        self.calls.append(str(s))
        m = self.model
        mb = s.num_microbatches(self.gb)
        rc = {"none": 1.0, "selective": 1.05, "full": 4 / 3}[s.recompute]
        eff = 0.5 * (1 - 0.03 * math.log2(s.tp)) * (0.9 + 0.1 * min(s.mbs, 4) / 4)
        comp = m.flops_per_token(self.seq) * self.gb * self.seq * rc / (s.world * 312e12 * eff)
        bub = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1 / s.vpp, "zb-h1": 0.5, "dualpipev": 0.4}[s.schedule]
        bf = bub * (s.pp - 1) / (mb + bub * (s.pp - 1))
        step = comp / (1 - bf) * (1 + 0.02 * s.zero)
        act = s.mbs * self.seq * m.hidden * 34 / s.tp * m.layers / s.pp
        act *= {"none": 1.0, "selective": 0.5, "full": 0.1}[s.recompute]
        peak = search.state_bytes_lower_bound(m, s) + (mb if s.schedule == "gpipe" else min(mb, s.pp)) * act
        tps = self.gb * self.seq / step
        status = "ok" if peak <= self.memory else "infeasible"
        return Outcome(status, "" if status == "ok" else "too big", step, tps, peak, 0.4, bf, 0.0, True, self.memory)


SMALL = dict(zero=(0, 1), mbs=(1, 2), schedules=("1f1b", "interleaved-1f1b", "zb-h1"), vpp=(2,),
             recompute=("none", "full"))


def small_space(devices=16, batch=64):
    return search.make_space("llama2-13b", "a800-16x8", devices=devices, global_batch=batch, seq_len=4096, **SMALL)


def optimum(space, ev):
    outs = [(ev(s), s) for s in space.enumerate()]
    return max(((o.tokens_per_s, str(s)) for o, s in outs if o.ok))


def test_tpe_finds_the_enumerated_optimum_of_a_tiny_space():
    sp = small_space()
    ev = Analytic("llama2-13b", 64, 4096, memory=40 * GIB)
    best_tps, best = optimum(sp, ev)
    n = len(sp.enumerate())
    res = search.tune("llama2-13b", "a800-16x8", devices=16, global_batch=64, seq_len=4096, n_trials=2 * n,
                      seed=3, space=sp, evaluate=Analytic("llama2-13b", 64, 4096, memory=40 * GIB))
    assert str(res.best.strategy) == best and res.best.tokens_per_s == pytest.approx(best_tps)
    assert res.feasible_trials > 0 and len(res.trials) == 2 * n


def test_invalid_points_are_pruned_with_a_reason_and_never_scored():
    sp = search.make_space("llama2-13b", "a800-16x8", devices=12, global_batch=48, seq_len=4096, **SMALL)
    ev = Analytic("llama2-13b", 48, 4096)
    res = search.tune("llama2-13b", "a800-16x8", devices=12, global_batch=48, seq_len=4096, n_trials=80, seed=0,
                      space=sp, evaluate=ev)
    df = res.trials
    invalid = df[df["status"] == "invalid"]
    assert len(invalid) > 0 and (invalid["state"] == "PRUNED").all()
    assert invalid["reason"].str.len().min() > 10 and invalid["tokens_per_s"].isna().all()
    assert all(not sp.problems(search.canonical(__import__("parashift").Strategy.parse(c))) for c in ev.calls)
    assert len(ev.calls) == len(set(ev.calls)) == res.evaluations   # each strategy scored once
    scored = set(df.loc[df["status"] != "invalid", "strategy"])
    assert scored == set(ev.calls)
    assert df["cached"].sum() == (df["status"] != "invalid").sum() - len(ev.calls)


def test_infeasible_strategies_are_never_best():
    ev = Analytic("llama2-13b", 64, 4096, memory=25 * GIB)
    res = search.tune("llama2-13b", "a800-16x8", devices=16, global_batch=64, seq_len=4096, n_trials=120, seed=1,
                      space=small_space(), evaluate=ev)
    df = res.trials
    bad = df[df["status"] == "infeasible"]
    assert len(bad) > 0 and (bad["peak_memory"] > 25 * GIB).all() and (bad["reason"] == "too big").all()
    ok = df[df["status"] == "ok"]
    assert res.best.peak_memory <= 25 * GIB
    assert res.best.tokens_per_s == pytest.approx(ok["tokens_per_s"].max())
    assert (bad["state"] == "COMPLETE").all()   # simulated, so Optuna sees the value and the constraint
    trials = res.study.trials
    for n in bad["number"]:  # the relative memory overflow, as an Optuna constraint TPE honors
        assert trials[n].constraints["memory"] == pytest.approx(trials[n].user_attrs["peak_memory"] / (25 * GIB) - 1)
    assert all(trials[n].constraints["memory"] == 0 for n in ok["number"])


def test_memory_precheck_rejects_without_compiling():
    ev = search.SimEvaluator("llama2-70b", "a800-1x8", global_batch=8, seq_len=4096)
    out = ev(__import__("parashift").Strategy(dp=1, tp=8, pp=1))
    assert out.status == "infeasible" and not out.simulated and "GiB per device" in out.reason


def test_sqlite_storage_resumes_the_study(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    kw = dict(devices=16, global_batch=64, seq_len=4096, storage=url, study_name="s13", space=small_space())
    ev1 = Analytic("llama2-13b", 64, 4096)
    r1 = search.tune("llama2-13b", "a800-16x8", n_trials=15, seed=0, evaluate=ev1, **kw)
    ev2 = Analytic("llama2-13b", 64, 4096)
    r2 = search.tune("llama2-13b", "a800-16x8", n_trials=15, seed=1, evaluate=ev2, **kw)
    assert len(r1.trials) == 15 and len(r2.trials) == 30
    assert not set(ev1.calls) & set(ev2.calls), "a resumed study re-scored a strategy it already had"
    assert r2.best.tokens_per_s >= r1.best.tokens_per_s
    import optuna
    loaded = optuna.load_study(study_name="s13", storage=url)   # Optuna's own tools read it
    assert len(loaded.trials) == 30 and all({"status", "reason"} <= set(t.user_attrs) for t in loaded.trials)
    assert any(t.user_attrs.get("strategy") == str(r2.best.strategy) for t in loaded.trials)
    with pytest.raises(SearchError, match="another setting"):
        search.tune("llama2-13b", "a800-16x8", n_trials=1, evaluate=ev2,
                    **{**kw, "global_batch": 128, "space": small_space(batch=128)})
    # a setting stored before the tp_async and grad_fusion axes existed resumes with them off, not offered
    setting = {k: v for k, v in loaded.user_attrs["parashift.setting"].items() if k not in ("tp_async", "grad_fusion")}
    loaded.set_user_attr("parashift.setting", setting)
    assert len(search.tune("llama2-13b", "a800-16x8", n_trials=1, evaluate=ev2, **kw).trials) == 31
    with pytest.raises(SearchError, match=r"differs in tp_async\)"):
        search.tune("llama2-13b", "a800-16x8", n_trials=1, evaluate=ev2,
                    **{**kw, "space": dataclasses.replace(small_space(), tp_async=(False, True))})


def test_multi_objective_returns_a_non_dominated_front():
    res = search.tune("llama2-13b", "a800-16x8", devices=16, global_batch=64, seq_len=4096, n_trials=120, seed=2,
                      objective=("throughput", "memory"), space=small_space(),
                      evaluate=Analytic("llama2-13b", 64, 4096))
    ok = res.trials[res.trials["status"] == "ok"]
    front = res.pareto
    assert len(front) >= 2
    assert [c.peak_memory for c in front] == sorted(c.peak_memory for c in front)
    for c in front:  # nothing feasible dominates a front point
        dom = (ok["tokens_per_s"] >= c.tokens_per_s) & (ok["peak_memory"] <= c.peak_memory) & (
            (ok["tokens_per_s"] > c.tokens_per_s) | (ok["peak_memory"] < c.peak_memory))
        assert not dom.any()
    names = {str(c.strategy) for c in front}
    for r in ok.itertuples():  # every feasible trial off the front is dominated by a front point
        if r.strategy not in names:
            assert any(c.tokens_per_s >= r.tokens_per_s and c.peak_memory <= r.peak_memory for c in front)
    assert res.best.tokens_per_s == max(c.tokens_per_s for c in front)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=12))
def test_pareto_mask_matches_brute_force(points):
    v = np.array(points, dtype=float)
    mask = search.pareto_mask(v, (True, False))
    for i, (a, b) in enumerate(points):
        dominated = any(c >= a and d <= b and (c > a or d < b) for c, d in points)
        assert mask[i] == (not dominated)


def test_bad_objective_and_sampler_are_explained():
    with pytest.raises(SearchError, match="throughput"):
        search.tune("tiny-gpt", "cpu-local", devices=2, global_batch=4, seq_len=32, n_trials=1, objective="speed",
                    evaluate=Analytic("tiny-gpt", 4, 32))
    with pytest.raises(SearchError, match="tpe"):
        search.tune("tiny-gpt", "cpu-local", devices=2, global_batch=4, seq_len=32, n_trials=1, sampler="grid",
                    evaluate=Analytic("tiny-gpt", 4, 32))


def test_trials_table_and_plot(tmp_path):
    res = search.tune("llama2-13b", "a800-16x8", devices=16, global_batch=64, seq_len=4096, n_trials=30, seed=0,
                      space=small_space(), evaluate=Analytic("llama2-13b", 64, 4096))
    df = res.trials
    assert list(df.columns) == list(search.result.TRIAL_COLUMNS)
    assert isinstance(df, pd.DataFrame) and set(df["status"]) <= {"ok", "infeasible", "invalid"}
    ok = df[df["status"] == "ok"]
    assert (ok["dp"] * ok["tp"] * ok["pp"] == 16).all()
    path = res.plot(str(tmp_path / "search.png"))
    assert (tmp_path / "search.png").stat().st_size > 10_000 and path.endswith("search.png")
    top = res.top(3)
    assert [c.tokens_per_s for c in top] == sorted((c.tokens_per_s for c in top), reverse=True)
    assert top[0].strategy == res.best.strategy
