"""Hybrid sharding (``shard=N``: ZeRO over groups of N dp ranks, replicated dp/N times): the strategy,
the rank grid, replica coverage against a brute-force reference, the planner's host-loss report, the
Program's collectives, simulated memory and a hot switch (training: test_exec_equivalence.py; a host
killed: test_hosts_live.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, models
from parashift.errors import StrategyError
from parashift.exec.job.recover import memory_plan, survivability, uncovered

from test_vps_layout import reference_holdings, strategies_for, tiny_models


@pytest.mark.parametrize("text,message", [
    ("dp=4,zero=1,shard=3", "shard=3 must divide dp=4"),
    ("dp=4,shard=2", "needs zero>=1"),
    ("dp=4,zero=1,cp=2,shard=2", "cp=2, ep=1 is not supported"),
    ("dp=4,zero=3,ep=2,shard=2", "cp=1, ep=2 is not supported"),
    ("dp=4,zero=1,shard=-1", "must be at least 1"),
    ("dp=4,zero=1,shard=x", "must be an integer"),
])
def test_parse_errors_say_what_to_do(text, message):
    with pytest.raises(StrategyError, match=message):
        Strategy.parse(text)


def test_text_form_and_the_whole_group_default():
    s = Strategy.parse("dp=4,zero=1,shard=2")
    assert str(s) == "dp=4,tp=1,pp=1,zero=1,shard=2" and Strategy.parse(str(s)) == s
    assert s.shard_size == 2 and s.dp_replicas == 2 and s.zero_ways == 2
    whole = Strategy.parse("dp=4,zero=1,shard=4")       # one group of every dp rank: today's ZeRO
    assert whole == Strategy.parse("dp=4,zero=1") and whole.dp_replicas == 1
    assert s.replace(dp=2) == Strategy.parse("dp=2,zero=1")


def test_groups_shard_consecutive_dp_ranks_and_replicate_across_them():
    s = Strategy.parse("dp=4,tp=2,pp=2,zero=1,shard=2")
    for axis in ("shard", "replica"):
        rows = s.groups(axis)
        assert sorted(rows.ravel().tolist()) == list(range(s.world))
        for row in rows:
            for r in row:
                assert s.group(int(r), axis) == tuple(int(x) for x in row)
    assert s.group(0, "shard") == (0, 2) and s.group(0, "replica") == (0, 4)   # dp 0,1 | dp 0,2 (tp fastest)
    c = s.coords(6)                                                            # tp 0, dp 3, pp 0
    assert (c["shard"], c["replica"]) == (1, 1)


def _missing(model, s: Strategy, lost: set[int]) -> dict[str, int]:
    """Brute force: elements of each kind (gradients aside) that no surviving rank holds."""
    held = reference_holdings(model, s)
    out: dict[str, int] = {}
    for kind in model.state_kinds:
        if kind == "grad":
            continue
        for i, t in enumerate(model.tensors):
            alive = [v for (r, j, k), v in held.items() if j == i and k == kind and r not in lost]
            every = [v for (r, j, k), v in held.items() if j == i and k == kind]
            if not every:
                continue
            n = np.setdiff1d(np.unique(np.concatenate(every)), np.concatenate(alive) if alive else []).size
            if n:
                out[kind] = out.get(kind, 0) + int(n)
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_replica_coverage_matches_brute_force(data):
    model = data.draw(tiny_models(moe=False))
    s = data.draw(strategies_for(model, max_world=8))
    lost = set(data.draw(st.sets(st.integers(0, s.world - 1), max_size=s.world)))
    assert uncovered(model, s, lost) == _missing(model, s, lost)


def test_hybrid_layout_survives_a_host_that_holds_one_replica_of_each_shard():
    model = models.get("tiny-gpt")
    hosts = {1: [0, 1], 2: [2, 3]}
    report = survivability(model, Strategy.parse("dp=4,zero=1,shard=2"), hosts, 8, snapshots=False)
    row = report[report.host == 2].iloc[0]
    assert (row.recovers_from, row.layout, row.missing) == ("replicas", "dp=2,tp=1,pp=1,zero=1", "")
    plain = survivability(model, Strategy.parse("dp=4,zero=1"), hosts, 8, snapshots=False)
    row = plain[plain.host == 2].iloc[0]
    assert row.recovers_from == "none" and "exp_avg" in row.missing
    # a host holding both members of one shard group loses nothing, the survivors keep their own shards
    st_, devs = memory_plan(model, Strategy.parse("dp=8,zero=1,shard=2"), tuple(range(8)), [0, 1, 2, 3, 6, 7], 16)
    assert str(st_) == "dp=4,tp=1,pp=1,zero=1,shard=2"
    assert [Strategy.parse("dp=8,zero=1,shard=2").coords(d)["shard"] for d in devs] == [0, 1, 0, 1]
    # both copies of a shard on one host (hosts {0, 2} / {1, 3}: shard 1 lives on dp 1 and 3): losing it is fatal
    crossed = survivability(model, Strategy.parse("dp=4,zero=1,shard=2"), {1: [0, 2], 2: [1, 3]}, 8, snapshots=False)
    assert crossed[crossed.host == 2].iloc[0].recovers_from == "none"


# ---- IR and simulator ------------------------------------------------------------------------------------
def test_program_reduce_scatters_in_the_shard_group_then_all_reduces_across_replicas():
    from parashift.ir.compile import compile
    p = compile("tiny-gpt", "dp=4,pp=2,zero=1,shard=2", global_batch=8, validate=True)
    for r in range(p.strategy.world):
        comm = [i for s in p.ranks[r].streams.values() for i in s if i.op != "compute" and i.tag.startswith("dp.")]
        rs = [i for i in comm if i.op == "reduce_scatter"]
        ar = [i for i in comm if i.op == "all_reduce"]
        ag = [i for i in comm if i.op == "all_gather"]
        assert rs and len(rs) == len(ar) == len(ag)
        assert {p.resolve_group(r, i) for i in rs + ag} == {p.strategy.group(r, "shard")}
        assert {p.resolve_group(r, i) for i in ar} == {p.strategy.group(r, "replica")}
        assert all(a.tag == f"dp.replica.c{a.chunk}" and a.nbytes == -(-g.nbytes // 2) for g, a in zip(rs, ar))
        # the shard's all-reduce follows its reduce-scatter and precedes the optimizer step
        pos = {i.id: k for k, i in enumerate(p.ranks[r].streams["comm"])}
        assert all(pos[g.id] < pos[a.id] for g, a in zip(rs, ar))


def test_simulated_state_memory_shards_by_the_group_not_dp():
    from parashift.ir.compile import compile
    from parashift.sim import simulate
    cols = ["param", "grad", "master", "optim"]
    hybrid = simulate(compile("llama2-7b", "dp=8,zero=1,shard=2", global_batch=16), "a100-1x8")
    small = simulate(compile("llama2-7b", "dp=2,zero=1", global_batch=16), "a100-1x8")
    whole = simulate(compile("llama2-7b", "dp=8,zero=1", global_batch=16), "a100-1x8")
    h, s, w = (x.memory_frame().iloc[0][cols].tolist() for x in (hybrid, small, whole))
    assert h == s and h[2] == 4 * w[2] and h[3] == 4 * w[3]
    # the same bytes cross the shard group and then the replicas: more time than one group of 8
    assert hybrid.step_time > whole.step_time


# ---- runtime (training equal to one process: tests/test_exec_equivalence.py, dp=4,zero=1,shard=2) ----
def test_hot_switch_into_and_out_of_a_hybrid_layout_is_byte_exact():
    from parashift.exec.switch.check import switch_check
    for src, dst in (("dp=4,zero=1", "dp=4,zero=1,shard=2"), ("dp=4,zero=1,shard=2", "dp=2,tp=2,zero=1")):
        got = switch_check("tiny-gpt", src, dst, transport="gloo")
        assert got["ok"] and not got["mismatches"], (src, dst, got["mismatches"])
