"""Custom placements (pure planning): any layer -> chunk -> stage map round-trips through a Program
(the lowering reads it back off the placed graph), and the default order for a placement no schedule
has is deadlock-free (the validator's replay is the oracle) for random placements, micro-batch counts
and split/unsplit backwards."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import parashift as ps
from parashift import directives as d
from parashift.ir.placement import PlacedStrategy, placed


@st.composite
def placements(draw, layers: int = 4):
    pp = draw(st.integers(1, 3))
    chunks = draw(st.integers(pp, min(layers, 6)))
    stages = list(range(pp)) + draw(st.lists(st.integers(0, pp - 1), min_size=chunks - pp, max_size=chunks - pp))
    stages = draw(st.permutations(stages))
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=chunks - 1, max_size=chunks - 1,
                                unique=True))) if chunks > 1 else []
    layer_chunk = np.searchsorted(np.asarray(cuts), np.arange(layers), side="right")
    return tuple(int(x) for x in layer_chunk), tuple(int(x) for x in stages)


@settings(max_examples=40, deadline=None)
@given(placements(layers=7))
def test_a_placement_round_trips_through_the_strategy(p):
    lc, cs = p
    s = placed(ps.Strategy(pp=max(cs) + 1), lc, cs)
    assert list(s.layer_stages(7)) == list(lc)
    assert [s.chunk_rank_stage(c) for c in range(len(cs))] == list(cs)
    if isinstance(s, PlacedStrategy):
        back = ps.ir.Program.from_json(ps.ir.Program(ranks={}, strategy=s,
                                                     meta={"placement": {"chunk_starts": list(s.chunk_starts),
                                                                         "chunk_stages": list(s.chunk_stages)}}).to_json())
        assert back.strategy == s


@settings(max_examples=60, deadline=None)
@given(placements(), st.integers(1, 5), st.booleans())
def test_any_placement_compiles_to_a_valid_deadlock_free_program(p, m, split):
    lc, cs = p
    table = {"embed": 0, "head": len(cs) - 1, **{f"layers.{i}": c for i, c in enumerate(lc)}}
    pp = max(cs) + 1
    try:
        prog = ps.ir.compile("tiny-gpt", "dp=1", global_batch=m, seq_len=16,
                             directives=[d.Place(table, stages=cs), d.Split(microbatches=m, backward=split)])
    except ps.StrategyError as e:      # exactly Megatron's interleaved placement: its recipe and its rule
        assert cs == tuple(c % pp for c in range(len(cs))) and len(cs) > pp and m % pp, e
        assert "multiple of pp" in str(e)
        return
    prog.validate()                                  # replays every stream: no deadlock, every send meets its recv
    assert list(prog.strategy.layer_stages(4)) == list(lc)
    assert [prog.strategy.chunk_rank_stage(c) for c in range(len(cs))] == list(cs)
    assert prog.world == max(cs) + 1
