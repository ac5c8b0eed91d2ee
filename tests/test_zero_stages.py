"""The ZeRO stage record (parashift.states): what each stage shards and how it moves state."""
from __future__ import annotations

import pytest

from parashift import Strategy
from parashift.errors import StrategyError
from parashift.states import KINDS, ZERO, ZERO_STAGE, zero_stage


def test_each_stage_shards_what_the_zero_paper_says():
    got = {z.level: tuple(k for k in KINDS if z.shards(k)) for z in ZERO}
    assert got == {0: (), 1: ("master", "exp_avg", "exp_avg_sq"), 2: ("grad", "master", "exp_avg", "exp_avg_sq"),
                   3: KINDS}
    assert ZERO_STAGE == {"param": 3, "grad": 2, "master": 1, "exp_avg": 1, "exp_avg_sq": 1}


def test_how_each_stage_moves_parameters_and_gradients():
    rows = [(str(z), z.sharded, z.grad_sync, z.grad_buckets, z.gathers_after_step, z.gathers_around_use) for z in ZERO]
    assert rows == [("ZeRO-0", False, "all_reduce", False, False, False),
                    ("ZeRO-1", True, "reduce_scatter", False, True, False),
                    ("ZeRO-2", True, "reduce_scatter", True, True, False),
                    ("ZeRO-3", True, "reduce_scatter", True, False, True)]


def test_a_strategy_answers_with_its_stage_and_bad_stages_say_the_fix():
    assert Strategy.parse("dp=4,zero=2").zero_stage is ZERO[2]
    with pytest.raises(StrategyError, match="use 0, 1, 2 or 3"):
        Strategy(dp=2, zero=4)
    with pytest.raises(StrategyError, match="use 0, 1, 2 or 3"):
        zero_stage(-1)
    with pytest.raises(KeyError, match="unknown state kind"):
        ZERO[1].shards("momentum")
