"""The lowering's fast parts against their plain definitions: instructions built from columns equal
``Instr(*row)``, the packed-key sort equals ``np.lexsort`` (also where the keys do not fit one int64),
and the pair-order replay waits on producers and reports stages that cannot proceed."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from parashift.ir import Instr
from parashift.ir.program import instrs_from_columns
from parashift.ir.scheduler import _rank, _replay, _sort

ROWS = [(0, "compute", "compute", (), "fwd", 1, 0, 3, "layers.0.attn", 1.5e12, 0, None, None, None, None, None,
         (("act.c0.m3", 1024),), ()),
        (7, "send", "p2p", (2, 5), None, None, None, 3, None, 0.0, 4096, "pp+1", None, None, "t.3", "k", (), ("x",)),
        (2, "all_reduce", "comm", (1,), "bwd", None, 1, None, None, 0.0, 8, None, "tp", 0, "ar", None, (), ())]


def test_instrs_from_columns_are_the_instructions_rows_make():
    got = instrs_from_columns(*zip(*ROWS))
    want = [Instr(*r) for r in ROWS]
    assert got == want and [type(i) for i in got] == [Instr] * 3 and list(map(hash, got)) == list(map(hash, want))
    assert [repr(i) for i in got] == [repr(i) for i in want]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got[0].id = 3
    with pytest.raises(TypeError):
        instrs_from_columns(*zip(*ROWS[:1]), [None])


@pytest.mark.parametrize("huge", [False, True])
def test_packed_sort_is_lexsort(huge):
    rng = np.random.default_rng(1)
    keys = [rng.integers(0, 4, 500), rng.integers(-3, 3, 500), rng.integers(0, 2**40 if huge else 50, 500)]
    assert np.array_equal(_sort(*keys), np.lexsort(keys[::-1]))
    uniq = [keys[0], np.arange(500)[::-1]]
    assert np.array_equal(_sort(*uniq, unique=True), np.lexsort(uniq[::-1]))
    x = rng.choice([0.5, -1.0, 2.25, 0.0], 100)
    assert np.array_equal(np.argsort(_rank(x), kind="stable"), np.argsort(x, kind="stable"))


def test_replay_waits_for_producers_and_leaves_blocked_stages_unrun():
    # stage 0: steps 0, 1; stage 1: steps 2, 3; step 2 needs step 0, step 1 needs step 3
    end = _replay([0, 2, 4], [1.0, 1.0, 2.0, 1.0], [0, 0, 1, 2, 2], [3, 0])
    assert end[:4] == [1.0 + 1e-6, ((1.0 + 1e-6 + 2.0 + 1e-6) + 1.0 + 1e-6) + 1.0 + 1e-6,
                       1.0 + 1e-6 + 2.0 + 1e-6, (1.0 + 1e-6 + 2.0 + 1e-6) + 1.0 + 1e-6] and end[4] is None
    # each waits for the other's second step: neither stage finishes
    end = _replay([0, 2, 4], [1.0] * 4, [0, 0, 1, 1, 2], [3, 1])
    assert end[1] is None and end[3] is None and end[0] == 1.0 + 1e-6
