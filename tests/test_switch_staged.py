"""Live switches under a memory budget: old state released stage by stage, restored on abort."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import cluster, models
from parashift.exec.switch import run_live
from parashift.strategy import Strategy
from parashift.vps import plan_switch
from parashift.vps.transition import plan_live_switch
from parashift.vps.transition.staging import state_buffers

from switch_faults import Corrupt, Kill
from test_switch_live import _bytes, assert_rolled_back, check_switches

# tensors of 64 KiB - 1 MiB, so that released regions span whole pages
GPT = models.gpt(2, 256, 4, kv_heads=4, ffn=1024, vocab=1024, seq_len=16, name="sw-staged", dtype="fp32", pad_vocab=8)


def _old_plus_new(src: str, dst: str, sd, dd) -> float:
    plan = plan_switch(GPT, Strategy.parse(src), Strategy.parse(dst), cluster=cluster.get("cpu-local").with_devices(8),
                       src_devices=list(sd), dst_devices=list(dd))
    buf = state_buffers(plan)
    return float(np.bincount(buf.dev, weights=(buf.old + buf.new).astype(float)).max())


def test_a_budget_below_old_plus_new_stages_the_switch_and_an_impossible_one_is_refused():
    from parashift.errors import MemoryBudgetError
    both = _old_plus_new("dp=2,tp=2,zero=1", "tp=4", range(4), range(4))
    whole = plan_live_switch(GPT, "dp=2,tp=2,zero=1", "tp=4", (0, 1, 2, 3), (0, 1, 2, 3), memory_budget=2 * both)
    assert not whole.staged and whole.program.meta["stages"] == 1
    staged = plan_live_switch(GPT, "dp=2,tp=2,zero=1", "tp=4", (0, 1, 2, 3), (0, 1, 2, 3),
                              memory_budget=int(0.8 * both))
    assert staged.staged and staged.program.meta["stages"] > 1
    with pytest.raises(MemoryBudgetError, match="needs"):
        plan_live_switch(GPT, "dp=2,tp=2,zero=1", "tp=4", (0, 1, 2, 3), (0, 1, 2, 3), memory_budget=int(0.4 * both))


def test_staged_switches_release_old_state_stay_under_budget_and_match_a_direct_start():
    budget = int(0.8 * _old_plus_new("tp=4", "dp=2,tp=2,zero=1", range(4), range(4)))
    chain = [(1, "tp=4", None), (2, "dp=2,tp=2,zero=1", None)]
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=4, switches=chain, export=True, memory_budget=budget,
                   timeout=240, switch_timeout=30)
    static = run_live(GPT, "dp=2,tp=2,zero=1", steps=4, timeout=240)
    assert [s.get("aborted") for s in res.switches] == [None, None]
    assert check_switches(GPT, res) == 2
    np.testing.assert_allclose(res.losses, static.losses, rtol=1e-5, atol=0)
    for r in res.reports.values():
        for sw in r["switches"]:
            assert sw["stages"] > 1
            assert sw["old_bytes"] + sw["new_bytes"] > budget       # holding both whole would not fit
            assert sw["released_bytes"] > 0.5 * sw["old_bytes"]     # most old state went back stage by stage
            assert sw["peak_bytes"] <= budget
            # measured: the process never held the new state on top of the whole old one
            assert 0 < sw["rss_peak_bytes"] - sw["rss_start_bytes"] < sw["new_bytes"]
            assert sum(op.startswith("release") for _, op, _, _ in sw["rows"]) == sw["stages"]


def test_staged_abort_restores_released_state_and_training_continues_unchanged():
    budget = int(0.8 * _old_plus_new("dp=2,tp=2,zero=1", "tp=4", range(4), range(4)))
    static = run_live(GPT, "dp=2,tp=2,zero=1", steps=3, export=True, timeout=120)
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=3, switches=[(1, "tp=4", None)], export=True, timeout=120,
                   memory_budget=budget, switch_timeout=20,
                   faults=Corrupt(device=2, switch=1, stage=2))
    (sw,) = res.switches
    assert "checksum" in sw["aborted"] and "rolled back" in sw["aborted"] and "at stage" in sw["aborted"]
    assert sw["released_bytes"] > 0                 # old state had been released before the failure ...
    assert res.losses == static.losses               # ... and came back bit for bit
    assert_rolled_back(res, static)


def test_killed_leaving_rank_mid_staged_switch_leaves_survivors_whole():
    budget = int(0.8 * _old_plus_new("dp=2,tp=2,zero=1", "dp=3,zero=1", range(4), range(3)))
    static = run_live(GPT, "dp=2,tp=2,zero=1", steps=1, export=True, timeout=120, global_batch=12)
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=3, switches=[(1, "dp=3,zero=1", (0, 1, 2))], timeout=120,
                   memory_budget=budget, switch_timeout=20, global_batch=12,
                   faults=Kill(device=3, switch=1, stage=1))
    assert res.reports["3.0"] is None                              # it died mid-switch, after stage 0
    want = {r["exports"]["final"]["rank"]: r["exports"]["final"]["arrays"] for r in static.reports.values()}
    survivors = [r for k, r in res.reports.items() if k != "3.0"]
    assert len(survivors) == 3
    for r in survivors:
        assert r["error"] and "aborted" in r["error"] and "restored" in r["error"]
        (sw,) = r["switches"]
        assert sw["released_bytes"] > 0
        rank, arrays = r["intact"]["rank"], r["intact"]["arrays"]
        assert all(_bytes(arrays[f][k]) == _bytes(want[rank][f][k]) for f in want[rank] for k in want[rank][f])
