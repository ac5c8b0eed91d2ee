"""Placement: the destination device order that keeps the most state, against brute force.

``keep_matrix`` is checked against the brute-force holdings of :mod:`test_vps_layout`; the
assignment against every permutation; ``plan_switch(placement="keep")`` against re-planning
under every within-node order of the destination devices.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import models, vps
from parashift.errors import PlanError
from parashift.vps.placement import assign_max, keep_matrix
from test_vps_layout import reference_holdings, strategies_for, tiny_models


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 6).flatmap(lambda n: st.lists(st.lists(st.integers(0, 9), min_size=n, max_size=n),
                                                     min_size=n, max_size=n)))
def test_assignment_is_a_best_permutation(rows):
    w = np.array(rows, dtype=np.int64).reshape(len(rows), len(rows))
    perm = assign_max(w)
    n = len(w)
    assert sorted(perm.tolist()) == list(range(n))
    best = max((sum(int(w[r, p[r]]) for r in range(n)) for p in itertools.permutations(range(n))), default=0)
    assert int(w[np.arange(n), perm].sum()) == best


def _reference_keep(model, src, dst, sdev, ddev, kinds) -> np.ndarray:
    """Bytes of rank r's destination state that device ddev[j] holds, from index sets."""
    s_hold, d_hold = reference_holdings(model, src), reference_holdings(model, dst)
    by_dev: dict[tuple[int, int, str], np.ndarray] = {}
    for (rank, t, k), idx in s_hold.items():
        key = (sdev[rank], t, k)
        by_dev[key] = np.union1d(by_dev.get(key, idx), idx)
    out = np.zeros((len(ddev), len(ddev)), dtype=np.int64)
    for (rank, t, k), idx in d_hold.items():
        if k not in kinds:
            continue
        for j, d in enumerate(ddev):
            have = by_dev.get((d, t, k))
            if have is not None:
                out[rank, j] += len(np.intersect1d(idx, have)) * model.kind_bytes(k)
    return out


@st.composite
def placements(draw):
    model = draw(tiny_models())
    src = draw(strategies_for(model, 6).filter(lambda s: s.world <= 8))
    dst = draw(strategies_for(model, 4).filter(lambda s: s.world <= 4))   # at most 4! orders to re-plan
    pool = max(src.world, dst.world) + draw(st.integers(0, 2))
    sdev = tuple(draw(st.permutations(range(pool)))[:src.world])
    ddev = tuple(draw(st.permutations(range(pool)))[:dst.world])
    per_node = draw(st.sampled_from([2, 4, 8]))
    return model, src, dst, sdev, ddev, f"a100-{-(-pool // per_node)}x{per_node}"


@settings(max_examples=40, deadline=None)
@given(placements())
def test_keep_placement_is_the_best_within_node_order(case):
    model, src, dst, sdev, ddev, clus = case
    given_plan = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=ddev)
    keep = keep_matrix(given_plan)
    assert np.array_equal(keep, _reference_keep(model, src, dst, sdev, ddev, given_plan.kinds))
    node = given_plan.cluster.node_of
    best = -1
    for order in itertools.permutations(ddev):
        if all(node(a) == node(b) for a, b in zip(order, ddev)):
            p = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=order)
            best = max(best, p.stats()["bytes_kept"])
    plan = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=ddev, placement="keep")
    plan.verify()
    assert sorted(plan.dst_devices) == sorted(ddev)
    assert all(node(a) == node(b) for a, b in zip(plan.dst_devices, ddev)), "a rank left its node"
    assert plan.stats()["bytes_kept"] == best
    if given_plan.stats()["bytes_kept"] == best:
        assert plan.dst_devices == ddev, "an order that is already best must stay"


def test_keep_placement_halves_the_bytes_of_a_tp_merge():
    """tp=2,dp=2 -> tp=4 on the same devices: in the given order devices 1 and 2 trade TP halves;
    the kept order (0,2,1,3) gives each device a quarter of the half it holds."""
    model = models.gpt(2, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="p-gpt", dtype="fp32",
                       pad_vocab=8)
    src, dst = "tp=2,dp=2,zero=1", "tp=4"
    plain = vps.plan_switch(model, src, dst, src_devices=(0, 1, 2, 3), dst_devices=(0, 1, 2, 3))
    kept = vps.plan_switch(model, src, dst, src_devices=(0, 1, 2, 3), dst_devices=(0, 1, 2, 3), placement="keep")
    assert kept.dst_devices == (0, 2, 1, 3)
    assert kept.stats()["bytes_moved"] * 1.9 < plain.stats()["bytes_moved"]
    with pytest.raises(PlanError, match="placement"):
        vps.plan_switch(model, src, dst, placement="best")
