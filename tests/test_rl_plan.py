"""Rollout Programs in the simulator and the planner of (training, rollout) layout pairs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from parashift.errors import StrategyError
from parashift.search.rl import plan_rl, rollout_layouts, weight_switch_seconds
from parashift.sim import simulate
from parashift.sim.rollout import rollout_program, simulate_rollout
from parashift.strategy import Strategy


def test_decode_is_memory_bound_and_grows_with_the_cache_prefill_is_heavier():
    step = [simulate(rollout_program("llama2-7b", "tp=2", prompts=64, tokens=1, past=p), "h100-16x8").step_time
            for p in (512, 4096, 16384)]
    assert step[0] < step[1] < step[2]
    pre = simulate(rollout_program("llama2-7b", "tp=2", prompts=8, tokens=512), "h100-16x8").step_time
    assert pre > step[0]
    p1 = rollout_program("llama2-7b", "tp=1", prompts=8, tokens=1, past=10)
    p2 = rollout_program("llama2-7b", "tp=2", prompts=8, tokens=1, past=10)
    assert p2.ranks[0].static_memory["weights"] < 0.51 * p1.ranks[0].static_memory["weights"]
    assert sum(i.op == "all_reduce" for i in p2.ranks[0].instrs()) == 2 * 32 + 1
    with pytest.raises(StrategyError, match="pp=1"):
        rollout_program("llama2-7b", "pp=2", prompts=8, tokens=1)
    with pytest.raises(StrategyError, match="replicas"):
        rollout_program("llama2-7b", "dp=4", prompts=6, tokens=1)


@settings(max_examples=6, deadline=None)
@given(k=st.integers(2, 12), samples=st.integers(2, 5))
def test_sampled_decode_time_matches_every_step_simulated(k, samples):
    exact = simulate_rollout("tiny-moe", "tp=2", "h100-16x8", prompts=4, prompt_len=8, rollout_tokens=k, samples=k)
    approx = simulate_rollout("tiny-moe", "tp=2", "h100-16x8", prompts=4, prompt_len=8, rollout_tokens=k,
                              samples=samples)
    assert approx.prefill_seconds == exact.prefill_seconds
    assert approx.decode_seconds == pytest.approx(exact.decode_seconds, rel=0.02)


def test_plan_picks_the_fastest_pair_and_compares_with_one_layout():
    train = ["dp=4,zero=1", "dp=2,pp=2", "dp=2,tp=2"]
    plan = plan_rl("llama2-7b", "h100-16x8", devices=4, prompts=16, prompt_len=256, rollout_tokens=128,
                   train=train)
    t = plan.table
    assert len(t) == 3 * len(rollout_layouts("llama2-7b", 4, 16))
    assert plan.best["iteration_seconds"] == t["iteration_seconds"].min()
    parts = t[["train_seconds", "rollout_seconds", "to_rollout_seconds", "to_train_seconds"]].sum(axis=1)
    assert (abs(parts - t["iteration_seconds"]) < 1e-12).all()
    assert plan.single is not None and plan.single["train"] in ("dp=4,tp=1,pp=1,zero=1", "dp=2,tp=2,pp=1")
    assert plan.best["iteration_seconds"] <= plan.single["iteration_seconds"] + 1e-6
    out, moved = weight_switch_seconds("llama2-7b", Strategy.parse("dp=2,pp=2"), Strategy.parse("tp=2"), "h100-16x8")
    assert out > 0 and moved > 0
    keep = plan_rl("llama2-7b", "h100-16x8", devices=4, prompts=16, prompt_len=256, rollout_tokens=128,
                   train=train[:1], rollout=["tp=2"], release=False)
    assert keep.best["to_train_seconds"] == 0.0
    freed = plan.table[(plan.table["train"] == keep.best["train"]) & (plan.table["rollout"] == keep.best["rollout"])]
    assert keep.best["rollout_peak_memory"] > freed["rollout_peak_memory"].iloc[0]     # the kept training weights
    assert plan.to_json()["speedup_over_single_layout"] >= 1 - 1e-9


def test_search_rl_cli_reports_the_best_pair_and_the_single_layout(capsys):
    import json

    from parashift.cli import main
    argv = ["search-rl", "--model", "llama2-7b", "--cluster", "h100-16x8", "--devices", "4", "--prompts", "16",
            "--prompt-len", "128", "--rollout-tokens", "64", "--train", "dp=4,zero=1", "--train", "dp=2,pp=2",
            "--rollout", "tp=2", "--rollout", "dp=4", "--top", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["pairs"]) == 2 and out["best"] == out["pairs"][0]
    assert out["single_layout"]["train"] == "dp=4,tp=1,pp=1,zero=1"
    assert main(argv[:-1]) == 0
    assert "best pair" in capsys.readouterr().out
    assert main(["search-rl", "--model", "llama2-7b", "--cluster", "h100-16x8", "--devices", "4", "--prompts", "6",
                 "--prompt-len", "8", "--rollout-tokens", "8", "--rollout", "dp=4", "--train", "dp=2"]) != 0
