"""Search over the devices available, ties broken by memory then simplicity, the step breakdown,
`--explain`, and both objectives agreeing on the throughput-optimal point."""
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, search
from parashift.cli import main
from parashift.search import Outcome
from parashift.search.result import Candidate, complexity, lost_on, rank_key

GIB = 2**30


@settings(max_examples=40, deadline=None)
@given(devices=st.integers(1, 24), batch=st.sampled_from([8, 12, 16, 24]))
def test_up_to_space_takes_the_largest_valid_dp_for_each_point(devices, batch):
    """Brute force: every point of the up-to space is a valid strategy on at most ``devices`` devices,
    and no larger dp would have been valid for the same tp, pp and other axes."""
    space = search.make_space("tiny-gpt", "a100-4x8", devices=devices, global_batch=batch, seq_len=32,
                              all_devices=False, schedules=("1f1b", "zb-h1"), recompute=("none",))
    full = {str(s) for s in search.make_space("tiny-gpt", "a100-4x8", devices=devices, global_batch=batch,
                                              seq_len=32, schedules=("1f1b", "zb-h1"),
                                              recompute=("none",)).enumerate()}
    got = space.enumerate()
    assert full <= {str(s) for s in got}          # everything on all devices is still a candidate
    for s in got:
        assert s.world <= devices and not space.problems(s)
        for dp in range(s.dp + 1, devices // (s.tp * s.pp) + 1):
            try:
                bigger = search.canonical(s.replace(dp=dp, zero=s.zero if s.dp > 1 else 0))
            except Exception:
                continue
            assert space.problems(bigger), f"{s}: dp={dp} also fits"


def test_the_issue_case_leaves_devices_idle_rather_than_a_19_stage_pipeline():
    res = search.tune("gpt3-1.3b", "a100-8x8", devices=38, global_batch=64, seq_len=2048, n_trials=200, seed=0)
    assert res.best.strategy.pp < 19 and res.best.world < 38
    assert res.best.tokens_per_s > 1.6 * 297_943            # the all-devices winner: dp=1,tp=2,pp=19
    only = search.tune("gpt3-1.3b", "a100-8x8", devices=38, global_batch=64, seq_len=2048, n_trials=30, seed=0,
                       all_devices=True)
    assert all(r.dp * r.tp * r.pp == 38 for r in only.trials.dropna(subset=["strategy"]).itertuples())


class Flat:
    """Step time from tp and pp only (zero and mbs change memory, not time)."""

    def __call__(self, s):
        step = 1.0 / s.world + 0.01 * (s.tp - 1) + 0.02 * (s.pp - 1)
        peak = 10 * GIB / (1 + s.zero) * s.mbs
        return Outcome("ok", "", step, 1024 / step, peak, 0.4, 0.0, 0.0, True, 80 * GIB, step, 0.0, 0.0)


def test_ties_go_to_less_memory_then_to_the_simpler_strategy():
    a = Candidate(Strategy.parse("dp=4,zero=1"), 1.0, 100.0, 5 * GIB)
    b = Candidate(Strategy.parse("dp=4,zero=3"), 1.0, 100.0 * (1 + 1e-9), 3 * GIB)
    c = Candidate(Strategy.parse("dp=4,zero=2"), 1.0, 100.0, 3 * GIB)
    assert sorted([a, b, c], key=rank_key) == [c, b, a]      # b ties c on tokens/s and memory, is less simple
    assert complexity(c.strategy) < complexity(b.strategy)
    plain = Strategy.parse("dp=2,tp=2")
    for opt in ("sp", "tp_async", "grad_fusion", "overlap_grad", "cp=2"):   # each option is machinery too
        assert complexity(plain) < complexity(Strategy.parse(f"dp=2,tp=2,{opt}"))
    assert complexity(Strategy.parse("dp=4,zero=1")) < complexity(Strategy.parse("dp=4,zero=1,shard=2"))
    assert "more memory" in lost_on(a, c) and "less simple" in lost_on(b, c)
    small = Candidate(Strategy.parse("dp=4,mbs=4"), 1.0, 100.0, 3 * GIB + 1.5 * 2**20)   # MiB apart: said in MiB
    assert lost_on(small, c) == "ties on throughput, needs 1.50 MiB more memory"
    assert str(c).endswith("peak 3.00 GiB") and str(small).endswith("peak 3.00 GiB")
    res = search.tune("llama2-13b", "a800-16x8", devices=16, global_batch=64, seq_len=4096, n_trials=60, seed=1,
                      evaluate=Flat())
    best = res.best
    ties = [c for c in res.top(100) if math.isclose(c.tokens_per_s, best.tokens_per_s, rel_tol=1e-9)]
    assert best.peak_memory == min(c.peak_memory for c in ties)


@pytest.mark.parametrize("seed", [0, 1])
def test_single_and_multi_objective_agree_on_the_throughput_optimum(seed):
    kw = dict(devices=16, global_batch=64, seq_len=4096, n_trials=40, seed=seed, evaluate=Flat())
    one = search.tune("llama2-13b", "a800-16x8", **kw)
    two = search.tune("llama2-13b", "a800-16x8", objective=("throughput", "memory"), **kw)
    assert one.best == two.best and two.pareto
    assert two.best.tokens_per_s == max(c.tokens_per_s for c in two.pareto)


def test_breakdown_sums_to_the_step_and_explain_names_what_runners_up_lost_on(capsys):
    ev = search.SimEvaluator("tiny-gpt", "cpu-local", global_batch=16, seq_len=32)
    for text in ("dp=2,pp=2", "dp=4,zero=1", "tp=2,dp=2"):
        o = ev(Strategy.parse(text))
        assert min(o.compute, o.exposed_comm, o.bubble) >= 0 and o.compute > 0
        assert o.compute + o.exposed_comm + o.bubble == pytest.approx(o.step_time, rel=1e-9)
    assert ev(Strategy.parse("dp=1,pp=4")).bubble > 0               # a pipeline idles
    assert main(["search", "--model", "tiny-gpt", "--cluster", "cpu-local", "--devices", "4", "--global-batch", "16",
                 "--seq-len", "32", "--trials", "25", "--seed", "0", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    b = out["breakdown"]
    assert set(b) == {"compute", "exposed_comm", "bubble", "peak_memory"} and b["peak_memory"] == out["best_peak_memory"]
    assert b["compute"] + b["exposed_comm"] + b["bubble"] == pytest.approx(out["best_step_time"])
    c = out["counts"]
    assert c["trials"] == 25 and c["simulated"] == out["evaluations"]
    assert out["explain"][0]["lost_on"] == "winner" and all(r["lost_on"] for r in out["explain"][1:])
    assert main(["search", "--model", "tiny-gpt", "--cluster", "cpu-local", "--devices", "4", "--global-batch", "16",
                 "--seq-len", "32", "--trials", "25", "--seed", "0", "--explain", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "= compute" in text and "why the winner won" in text and "simulated (the others" in text and "pruned as unable to beat" in text


class PowersOfTwo:
    """Only power-of-two worlds run fast: an awkward device count should leave devices idle."""

    def __call__(self, s):
        fast = s.world & (s.world - 1) == 0
        step = (1.0 / s.world if fast else 5.0) + 0.01 * (s.tp + s.pp)
        return Outcome("ok", "", step, 1024 / step, GIB, 0.4, 0.0, 0.0, True, 80 * GIB, step, 0.0, 0.0)


def test_trace_planner_uses_the_same_rule():
    import pandas as pd
    trace = pd.DataFrame({"time": [0.0, 100.0, 200.0, 300.0], "devices": [4, 3, 4, 4]})
    kw = dict(global_batch=8, seq_len=32, evaluate=PowersOfTwo(), switch_cost=lambda a, b: search.SwitchCost(0.0, "x"),
              restart_cost=lambda a, b: search.SwitchCost(1.0, "x"))
    plan = search.plan_trace(trace, "tiny-gpt", "cpu-local", **kw)
    three = plan.per_count.set_index("devices").loc[3]
    assert three["world"] == 2 and three["tokens_per_s"] > 1024 / 1.0
    strict = search.plan_trace(trace, "tiny-gpt", "cpu-local", all_devices=True, **kw)
    assert strict.per_count.set_index("devices").loc[3, "world"] in (0, 3)
