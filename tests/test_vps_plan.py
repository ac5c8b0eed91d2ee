"""Switch plans, checked by moving real numbers.

Every tensor of every kind is filled with distinct values, cut per the source layout of the
brute-force reference into per-device memories, the plan's pieces are applied, and each
destination device must end up with exactly its reference shards, bit for bit, every
element written once.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, cluster as clusters, models, vps
from parashift.errors import ClusterError, DeviceListError, PlanError, StrategyError, UnknownPresetError
from test_vps_layout import reference_holdings, strategies_for, tiny_models


def _truth(model, kinds):
    """Distinct values for every element of every (tensor, kind)."""
    out, base = {}, 0
    for k in kinds:
        for i, t in enumerate(model.tensors):
            out[(i, k)] = (base + np.arange(t.numel, dtype=np.int64)).reshape(t.shape)
            base += t.numel
    return out


def _memories(model, s, devices, kinds, truth):
    """device -> (tensor, kind) -> (values, held mask) from the reference holdings."""
    mem: dict[int, dict] = {}
    for (rank, i, k), idx in reference_holdings(model, s).items():
        if k not in kinds:
            continue
        vals = np.full(model.tensors[i].numel, -1, dtype=np.int64)
        vals[idx] = truth[(i, k)].ravel()[idx]
        mask = np.zeros(model.tensors[i].numel, dtype=bool)
        mask[idx] = True
        mem.setdefault(devices[rank], {})[(i, k)] = (vals.reshape(model.tensors[i].shape),
                                                     mask.reshape(model.tensors[i].shape))
    return mem


def check_plan_moves_state(plan, model, src, dst, sdev, ddev):
    """Apply the plan to real values; return the bytes the destinations lacked."""
    kinds = plan.kinds
    truth = _truth(model, kinds)
    old = _memories(model, src, sdev, kinds, truth)
    want = _memories(model, dst, ddev, kinds, truth)
    new = {d: {key: (np.full(v.shape, -1, dtype=np.int64), np.zeros(v.shape, dtype=np.int64))
               for key, (v, _) in m.items()} for d, m in want.items()}
    node = plan.cluster.node_of
    frame = plan.to_frame()
    index = {n: i for i, n in enumerate(plan.src_layout.table.names)}
    for n, row in enumerate(frame.itertuples()):
        i = index[row.tensor]
        box = tuple(slice(a, b) for a, b in zip(row.lo, row.hi))
        # the recorded holder set is exactly the devices holding the piece (none holds a part of it)
        part = {d for d, m in old.items() if (i, row.kind) in m and m[(i, row.kind)][1][box].any()}
        full = {d for d in part if old[d][(i, row.kind)][1][box].all()}
        assert part == full == set(plan.holder_devices(n).tolist()) and row.src in full
        vals, held = old[row.src][(i, row.kind)]
        assert held[box].all(), f"device {row.src} sends {row.tensor} {row.kind} {box} it does not hold"
        out, count = new[row.dst][(i, row.kind)]
        out[box] = vals[box]
        count[box] += 1
        assert row.nbytes == vals[box].size * model.kind_bytes(row.kind)
        if row.src != row.dst:
            # nothing moves that the destination already holds
            mine = old.get(row.dst, {}).get((i, row.kind))
            assert mine is None or not mine[1][box].any(), "moved bytes the destination already had"
            # no device on the destination's node could have served any of it
            if node(row.src) != node(row.dst):
                for d, m in old.items():
                    if d != row.dst and node(d) == node(row.dst) and (i, row.kind) in m:
                        assert not m[(i, row.kind)][1][box].any(), "skipped a same-node holder"
    needed = 0
    for d, m in want.items():
        for key, (vals, mask) in m.items():
            out, count = new[d][key]
            assert np.array_equal(count, mask.astype(np.int64)), f"device {d} {key}: not written exactly once"
            assert np.array_equal(out[mask], vals[mask]), f"device {d} {key}: wrong values"
            had = old.get(d, {}).get(key)
            lack = mask & ~had[1] if had is not None else mask
            needed += int(lack.sum()) * model.kind_bytes(key[1])
    return needed


@st.composite
def switches(draw, moe=None, max_world=16):
    model = draw(tiny_models(moe))
    src = draw(strategies_for(model, max_world))
    dst = draw(strategies_for(model, max_world))
    pool = max(src.world, dst.world) + draw(st.integers(0, 4))
    sdev = draw(st.permutations(range(pool)))[:src.world]
    ddev = draw(st.permutations(range(pool)))[:dst.world]
    per_node = draw(st.sampled_from([1, 2, 4]))
    kinds = draw(st.sampled_from([vps.DEFAULT_KINDS, vps.KINDS, ("param",), ("exp_avg", "param")]))
    return model, src, dst, tuple(sdev), tuple(ddev), f"a100-{-(-pool // per_node)}x{per_node}", kinds


def _run(case):
    model, src, dst, sdev, ddev, clus, kinds = case
    if "master" in kinds and model.dtype == "fp32" and kinds != vps.DEFAULT_KINDS:
        kinds = tuple(k for k in kinds if k != "master")
    plan = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=ddev, kinds=kinds)
    plan.verify()
    needed = check_plan_moves_state(plan, model, src, dst, sdev, ddev)
    st_ = plan.stats()
    assert st_["bytes_moved"] == st_["bytes_needed"] == needed
    assert st_["bytes_kept"] + st_["bytes_moved"] == int(plan.nbytes.sum())
    return plan


@settings(max_examples=70, deadline=None)
@given(switches())
def test_random_switches_move_state_exactly(case):
    _run(case)


@settings(max_examples=25, deadline=None)
@given(switches(moe=True))
def test_random_moe_switches_move_state_exactly(case):
    _run(case)


@pytest.mark.parametrize("src,dst,sdev,ddev", [
    ("dp=2,tp=2,pp=2,zero=1", "dp=1,tp=2,pp=3,zero=1", None, "0-5"),            # shrink, pp change
    ("dp=2,tp=2,pp=2,zero=3", "dp=4,tp=2,pp=2,zero=0", "0-7", "0-15"),          # growth, ZeRO off
    ("dp=4,tp=2,zero=2", "dp=2,pp=2,vpp=2,tp=2,zero=2", "8-15", "0-7"),        # disjoint devices
    ("dp=2,pp=2,vpp=2,schedule=dualpipev,zero=1", "dp=4,zero=1", None, None),
])
def test_tiny_gpt_switches(src, dst, sdev, ddev):
    model = models.get("tiny-gpt")
    s, d = Strategy.parse(src), Strategy.parse(dst)
    sd = tuple(clusters.parse_devices(sdev, s.world))
    dd = tuple(clusters.parse_devices(ddev, d.world))
    _run((model, s, d, sd, dd, "a100-2x8", vps.DEFAULT_KINDS))


def test_tiny_moe_changing_ep_and_tied_gpt3_style():
    _run((models.get("tiny-moe"), Strategy.parse("dp=4,ep=4,zero=1"), Strategy.parse("dp=2,tp=2,ep=2,zero=1"),
          tuple(range(4)), tuple(range(4)), "a100-1x4", vps.DEFAULT_KINDS))
    tied = models.gpt(4, 16, 4, vocab=64, seq_len=16, tied=True, pos_emb="learned", norm="ln", bias=True,
                      name="tied", pad_vocab=8)
    _run((tied, Strategy.parse("dp=3,pp=2,zero=1"), Strategy.parse("dp=2,pp=4,tp=2,zero=2"),
          tuple(range(6)), tuple(range(16)), "a100-2x8", vps.KINDS))


def test_identity_switch_keeps_everything():
    plan = vps.plan_switch("tiny-moe", "dp=2,tp=2,ep=2,zero=1", "dp=2,tp=2,ep=2,zero=1").verify()
    s = plan.stats()
    assert s["bytes_moved"] == s["bytes_needed"] == s["messages"] == 0 and s["bytes_kept"] > 0
    assert (plan.src == plan.dst).all()


def test_same_node_sources_are_preferred():
    # dp=2 replicas on nodes 0 and 1; the destination runs dp=1 on node 1 -> everything it lacks
    # is on node 1 already (tp shards moved within the node), so no byte crosses nodes
    model = models.gpt(2, 16, 4, vocab=32, seq_len=8, name="t4", pad_vocab=8)
    plan = vps.plan_switch(model, "dp=2,tp=2", "tp=4", cluster="a100-2x4",
                           src_devices="0,1,4,5", dst_devices="4-7").verify()
    s = plan.stats()
    assert s["bytes_moved"] > 0 and s["bytes_inter_node"] == 0


def test_sources_are_balanced():
    # 4 replicas, 4 new devices on another node: each replica sends about a quarter
    plan = vps.plan_switch("tiny-gpt", "dp=4", "dp=4", cluster="a100-8x1",
                           src_devices="0-3", dst_devices="4-7").verify()
    sent = np.bincount(plan.src[plan.moved], weights=plan.nbytes[plan.moved], minlength=4)[:4]
    assert sent.min() > 0 and sent.max() / sent.min() < 1.5


def test_medium_scale_plan_verifies():
    plan = vps.plan_switch("llama2-7b", "dp=8,tp=4,pp=2,zero=1", "dp=4,tp=2,pp=6,zero=2", cluster="a800-8x8",
                           dst_devices="0-39,48-55").verify()
    s = plan.stats()
    assert s["bytes_moved"] == s["bytes_needed"] > 0
    assert 0 < s["bytes_inter_node"] <= s["bytes_moved"]
    df = plan.to_frame()
    assert list(df.columns) == ["tensor", "kind", "src", "dst", "lo", "hi", "nbytes"]
    assert set(df.dst) == set(range(40)) | set(range(48, 56))


def test_verify_catches_corrupt_plans():
    plan = vps.plan_switch("tiny-gpt", "dp=2,zero=1", "tp=2,zero=1")
    moved = np.flatnonzero(plan.moved)
    import dataclasses
    dup = dataclasses.replace(plan, **{f: np.concatenate([getattr(plan, f), getattr(plan, f)[moved[:1]]])
                                       for f in ("tensor", "kind", "src", "dst", "lo", "hi", "nbytes")})
    with pytest.raises(PlanError, match="not covered exactly once"):
        dup.verify()
    keep = np.ones(len(plan), dtype=bool)
    keep[moved[0]] = False
    gap = dataclasses.replace(plan, **{f: getattr(plan, f)[keep]
                                       for f in ("tensor", "kind", "src", "dst", "lo", "hi", "nbytes")})
    with pytest.raises(PlanError, match="covers"):
        gap.verify()
    wrong = plan.src.copy()
    wrong[moved[0]] = plan.dst[moved[0]]          # claim it was kept: the destination never held it
    with pytest.raises(PlanError, match="does not hold"):
        dataclasses.replace(plan, src=wrong).verify()
    fat = plan.nbytes.copy()
    fat[0] += 1
    with pytest.raises(PlanError, match="bytes for"):
        dataclasses.replace(plan, nbytes=fat).verify()


def test_bad_input_errors():
    with pytest.raises(UnknownPresetError, match="presets are"):
        vps.plan_switch("llama-9", "dp=2", "dp=1")
    with pytest.raises(StrategyError, match="tp=3 must divide"):
        vps.plan_switch("tiny-gpt", "dp=2", "tp=3")
    with pytest.raises(DeviceListError, match="runs 4 ranks but 3 destination devices"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=4", dst_devices="0-2")
    with pytest.raises(DeviceListError, match="names a device twice"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=2", src_devices=[1, 1])
    with pytest.raises(ClusterError, match="not in a100-1x8"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=2", cluster="a100-1x8", dst_devices="7,8")
    with pytest.raises(UnknownPresetError, match="unknown cluster"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=2", cluster="b300-1x8")
    with pytest.raises(PlanError, match="unknown state kind"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=2", kinds=("param", "momentum"))
    with pytest.raises(PlanError, match="keeps no master copy"):
        vps.plan_switch("tiny-gpt", "dp=2", "dp=2", kinds=("param", "master"))
