"""Partial live switches of the weights into a rollout layout and back (gloo, tiny models)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from parashift import models
from parashift.errors import StrategyError
from parashift.exec.launch import launch_local
from parashift.exec.rl.weights import WeightSwitch, check_rollout
from parashift.exec.switch.stores import full_from_arrays
from parashift.strategy import Strategy
from parashift.vps.plan import plan_switch
from rl_workers import round_trip


def _full(model, strategy, per_rank, kind):
    spec = models.get(model)
    got = full_from_arrays(spec, Strategy.parse(strategy), {r: a for r, a in per_rank.items() if a is not None})
    return {name: arr for (name, k), arr in got.items() if k == kind}


@pytest.mark.parametrize("model,train,rollout,n", [
    ("tiny-gpt", "dp=2,tp=2,zero=1", "tp=2", 4),          # rollout on 2 of 4 devices, the others idle
    ("tiny-moe", "dp=4,ep=2", "tp=2,dp=2", 4),            # experts from EP shards to TP shards with replicas
])
def test_weights_round_trip_releases_and_restores_training_state_bit_exactly(model, train, rollout, n):
    res = launch_local(round_trip, n, args=(model, train, rollout, "fp32", True, ("param",)), timeout=180)
    for r in res:
        for fam in r["before"]:
            for k in r["before"][fam]:
                assert np.array_equal(r["before"][fam][k], r["after"][fam][k]), (fam, k)
        assert all(v == 0 for v in r["released"].values())       # the training weights were freed meanwhile
    want = _full(model, train, {i: r["before"] for i, r in enumerate(res)}, "param")
    got = _full(model, rollout, {i: r["rollout"] for i, r in enumerate(res)}, "param")
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert all(r["rollout"] is None for r in res[Strategy.parse(rollout).world:])


def test_bf16_rollout_copy_is_cast_and_optimizer_state_moves_only_when_chosen():
    res = launch_local(round_trip, 2, args=("tiny-gpt", "dp=2,zero=1", "tp=2", "bf16", False, ("param",)),
                       timeout=180)
    assert res[0]["rollout_dtype"] == "torch.bfloat16"
    want = _full("tiny-gpt", "dp=2,zero=1", {i: r["before"] for i, r in enumerate(res)}, "param")
    got = _full("tiny-gpt", "tp=2", {i: r["rollout"] for i, r in enumerate(res)}, "param")
    for name in want:
        cast = torch.from_numpy(want[name]).to(torch.bfloat16).float().numpy()
        assert np.array_equal(got[name], cast), name
    fp32 = plan_switch("tiny-gpt", "dp=2,zero=1", "tp=2", kinds=("param",)).stats()["bytes_moved"]
    assert sum(r["sent"] for r in res) == pytest.approx(fp32 / 2, rel=0.01)      # bf16 on the wire
    for r in res:       # the training copy was kept, untouched
        assert all(np.array_equal(r["before"][f][k], r["after"][f][k]) for f in r["before"] for k in r["before"][f])
    res = launch_local(round_trip, 2, args=("tiny-gpt", "dp=2,zero=1", "tp=2", "fp32", False,
                                            ("param", "exp_avg")), timeout=180)
    want = _full("tiny-gpt", "dp=2,zero=1", {i: r["before"] for i, r in enumerate(res)}, "exp_avg")
    got = _full("tiny-gpt", "tp=2", {i: r["rollout"] for i, r in enumerate(res)}, "exp_avg")
    assert np.abs(np.concatenate([v.ravel() for v in want.values()])).max() > 0
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_rollout_layouts_and_options_are_checked():
    spec = models.get("tiny-gpt")
    with pytest.raises(StrategyError, match="rollout layout holds weights only"):
        check_rollout(spec, "dp=2", "pp=2")
    with pytest.raises(StrategyError, match="needs 4 devices"):
        check_rollout(spec, "dp=2", "dp=4")
    with pytest.raises(StrategyError, match="release=True"):
        WeightSwitch(spec, "dp=2", "tp=2", 0, dtype="bf16", release=True, world=object())
    with pytest.raises(StrategyError, match="weights only"):
        WeightSwitch(spec, "dp=2", "tp=2", 0, dtype="bf16", kinds=("param", "exp_avg"), world=object())
