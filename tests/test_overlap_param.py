"""``overlap_param``: the ZeRO-1/2 parameter all-gathers move from after the optimizer to the next
step's forward (one per region bucket), expressed in the Program alone: the simulator prices the
overlap with no special case and the runtime executes the same instructions."""
from __future__ import annotations

import pytest

from parashift import Strategy
from parashift.errors import StrategyError
from parashift.ir import compile
from parashift.ir.tags import Sync, SyncTag, parse_tag
from parashift.sim import simulate


def test_overlap_param_is_a_strategy_key_that_round_trips():
    s = Strategy.parse("dp=4,zero=1,overlap_param")
    assert s.overlap_param and str(s) == "dp=4,tp=1,pp=1,zero=1,overlap_param"
    assert Strategy.parse(str(s)) == s
    assert not Strategy.parse("dp=4,zero=2,overlap_param=off").overlap_param
    assert "overlap_param" not in str(Strategy.parse("dp=4,zero=1"))


@pytest.mark.parametrize("text,fix", [("dp=4,overlap_param", "zero=0: nothing is gathered"),
                                      ("dp=4,zero=3,overlap_param", "ZeRO-3 already gathers"),
                                      ("dp=4,zero=1,overlap_param=maybe", "on or off")])
def test_overlap_param_errors_say_the_fix(text, fix):
    with pytest.raises(StrategyError, match=fix):
        Strategy.parse(text)
    with pytest.raises(StrategyError, match="boolean"):
        Strategy(dp=2, zero=1, overlap_param="yes")  # type: ignore[arg-type]


def _param_gathers(prog):
    out = {}
    for r, rp in prog.ranks.items():
        for ins in rp.streams.get("comm", ()):
            tag = parse_tag(ins.tag)
            if isinstance(tag, SyncTag) and tag.what is Sync.PARAM:
                out.setdefault(r, []).append(ins)
    return out


@pytest.mark.parametrize("model,strategy", [
    ("tiny-gpt", "dp=2,zero=1"), ("tiny-gpt", "dp=2,pp=2,zero=2"), ("tiny-gpt", "dp=2,tp=2,pp=2,vpp=2,zero=1"),
    ("tiny-gpt", "dp=2,pp=2,schedule=zb-h1,zero=1"), ("tiny-gpt", "dp=2,pp=2,vpp=2,schedule=dualpipev,zero=2"),
    ("tiny-moe", "dp=4,ep=2,zero=1"), ("tiny-moe", "dp=4,ep=2,pp=2,zero=2,schedule=gpipe")])
def test_gathers_precede_their_bucket_and_the_program_validates(model, strategy):
    """Same bytes as the gathers after the optimizer, now before each bucket's first forward,
    none behind the optimizer; the Program is deadlock-free (validate)."""
    base = compile(model, strategy, global_batch=8, seq_len=32)
    prog = compile(model, strategy + ",overlap_param", global_batch=8, seq_len=32, validate=True)
    before, after = _param_gathers(base), _param_gathers(prog)
    assert set(before) == set(after)
    for r, gathers in after.items():
        assert sum(i.nbytes for i in gathers) == sum(i.nbytes for i in before[r])
        rp = prog.ranks[r]
        by_id = {i.id: i for i in rp.instrs()}
        comm = [i.id for i in rp.streams["comm"]]
        at = {g.id: comm.index(g.id) for g in gathers}
        for g in gathers:          # deps name the latest producer per stream: later gathers imply g
            region = parse_tag(g.tag).region
            users = [i for i in rp.streams["compute"] if i.phase == "fwd" and i.microbatch == 0
                     and i.chunk == g.chunk and any(at.get(d, -1) >= at[g.id] for d in i.deps)]
            assert users, g
            if region is not None:
                assert users[0].region == region
            assert all(by_id[d].phase != "optim" for d in g.deps)
        syncs = [k for k, i in enumerate(rp.streams["comm"]) if i.tag.split(".")[1:2] == ["grad"]]
        assert max(at.values()) < max(syncs)     # the optimizer (behind the last sync) follows every gather


def _compute_busy(res):
    busy = {}
    for rep, _stream, ins, a, b in res.raw.records:
        if ins.op == "compute":
            busy[rep] = busy.get(rep, 0.0) + (b - a)
    return busy


@pytest.mark.parametrize("strategy", ["dp=8,tp=4,zero=1", "dp=8,tp=2,pp=2,zero=1", "dp=16,tp=2,zero=2"])
def test_overlap_param_hides_the_gather_behind_the_forward_and_leaves_compute_alone(strategy):
    """llama2-7b on 4 A100 nodes, DP across nodes: the gathers after the optimizer are exposed; in
    the next step's forward they mostly hide. Compute is untouched, and so is the memory peak."""
    runs = {}
    for extra in ("", ",overlap_param"):
        runs[extra] = simulate(compile("llama2-7b", strategy + extra, global_batch=64), "a100-4x8")
    off, on = runs[""], runs[",overlap_param"]
    busy_off, busy_on = _compute_busy(off), _compute_busy(on)
    assert busy_on == pytest.approx(busy_off, rel=1e-12)
    exposed_off = off.step_time - max(busy_off.values())
    exposed_on = on.step_time - max(busy_on.values())
    gathered = max(b - a for rep, _s, ins, a, b in off.raw.records
                   if ins.op == "all_gather" and ins.tag.startswith("dp.param"))
    assert gathered > 0.01                                   # the gather is significant here
    assert exposed_on < exposed_off - 0.5 * gathered
    assert on.peak_memory_max == off.peak_memory_max


@pytest.mark.slow
def test_runtime_memory_matches_the_simulator_under_overlap_param():
    from parashift.exec import run
    strategy, gb, seq = "dp=2,pp=2,zero=1,overlap_param", 8, 32
    res = run("tiny-gpt", strategy, steps=1, global_batch=gb, seq_len=seq, timeout=120, profile=False)
    sim = simulate(compile("tiny-gpt", strategy, global_batch=gb, seq_len=seq), "a100-1x8").peak_memory
    for r, measured in enumerate(res.peak_memory):
        assert measured == pytest.approx(sim[r], rel=0.10), r
