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

from parashift import cluster as clusters, models, vps
from parashift.cost import CostModel
from parashift.errors import ClusterError, PlanError, UnknownGPUError
from parashift.strategy import Strategy
from parashift.vps.placement import assign_max, keep_matrix
from parashift.vps.transition import SwitchMeta, place, plan_live_switch
from parashift.vps.transition.sources import select_sources
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
    if draw(st.booleans()):          # a live job's hosts: any sizes, in any order of the device ids
        hosts = draw(st.lists(st.integers(0, 3), min_size=pool, max_size=pool))
        return model, src, dst, sdev, ddev, clusters.get("a100-1x8").on_hosts(hosts)
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


def test_a_host_map_places_devices_on_hosts_of_any_size():
    c = clusters.get("cpu-local").on_hosts([7, 7, 7, 3, 3, 9])
    assert (c.nodes, c.per_node, c.devices, c.node_map) == (3, 3, 6, (0, 0, 0, 1, 1, 2))
    assert c.node_of(4) == 1 and c.node_of(np.array([0, 3, 5])).tolist() == [0, 1, 2]
    assert c.name == "cpu-local:hosts=3+2+1"
    assert c.with_devices(8).node_map == (0, 0, 0, 1, 1, 2, 3, 3)     # extra devices on new nodes
    with pytest.raises(ClusterError, match="device 6"):
        c.node_of(6)
    for bad in ([], [-1, 0]):
        with pytest.raises(ClusterError, match="host"):
            clusters.get("cpu-local").on_hosts(bad)
    named = clusters.get("a100-4x8:nic_bw=25GB,hosts=8+8+4")          # the same by name; the name round-trips
    assert (named.nodes, named.per_node, named.devices, named.nic_bw) == (3, 8, 20, 25e9)
    assert named.node_of(np.array([7, 8, 16])).tolist() == [0, 1, 2]
    assert clusters.get(named.name).node_map == named.node_map
    for bad, what in (("a100-1x8:hosts=8+x", "joined by"), ("a100-1x8:hosts=0+2", "joined by"),
                      ("a100-1x8:hosts=4+4,per_node=4", "drop nodes"),
                      ("a100-1x8:hosts=99999999999", "at most")):
        with pytest.raises(ClusterError, match=what):
            clusters.get(bad)


@settings(max_examples=40, deadline=None)
@given(placements())
def test_moved_pieces_come_from_the_receivers_node_when_it_holds_a_copy(case):
    """Brute force over the pieces: a piece with a holder on its receiver's node (host) is taken
    from that node, by the router and still after the lowering's source selection."""
    model, src, dst, sdev, ddev, clus = case
    plan = vps.plan_switch(model, src, dst, cluster=clus, src_devices=sdev, dst_devices=ddev)
    chosen = select_sources(plan, plan.cluster, CostModel.for_cluster(plan.cluster))
    node = plan.cluster.node_of
    for p in (plan, chosen):
        for i in np.flatnonzero(p.moved):
            holders = p.holder_devices(i).tolist()
            assert int(p.src[i]) in holders
            if any(node(h) == node(int(p.dst[i])) for h in holders):
                assert node(int(p.src[i])) == node(int(p.dst[i])), f"piece {i} crossed nodes with a copy on its own"


def _cross_host(planned, hosts) -> int:
    h = np.asarray(hosts)
    return sum(ins.nbytes for d, rp in planned.program.ranks.items() for ins in rp.instrs()
               if ins.op == "send" and h[d] != h[ins.peer])


def test_a_one_host_live_switch_is_one_node_however_many_processes():
    from parashift.vps.transition import live_cluster
    for n in (4, 12, 40):
        c = live_cluster(range(n))
        assert c.nodes == 1 and c.devices >= n and int(np.max(c.node_of(np.arange(n)))) == 0


def test_a_live_switch_keeps_tensor_parallel_groups_on_their_hosts():
    """Two hosts of two processes, tp=4 -> tp=2,dp=2: without the host map the kept order (0,2,1,3)
    puts each TP pair on two hosts (every step's TP traffic off-host); with it each pair stays on
    its host. Three hosts, pp=2,dp=3 -> tp=2,dp=2: every piece has a copy on its receiver's host
    or on another, and the host-aware plan takes the near one (fewer bytes between hosts)."""
    model = models.gpt(4, 256, 8, ffn=1024, vocab=1024, seq_len=64, name="h-gpt", dtype="fp32", pad_vocab=64)
    hosts = (1, 1, 2, 2, 3, 3)
    tp4, tp2 = Strategy.parse("tp=4"), Strategy.parse("tp=2,dp=2")
    assert place(model, tp4, tp2, (0, 1, 2, 3), (0, 1, 2, 3)) == (0, 2, 1, 3)
    order = place(model, tp4, tp2, (0, 1, 2, 3), (0, 1, 2, 3), hosts)
    assert [{hosts[d] for d in order[i:i + 2]} for i in (0, 2)] == [{1}, {2}]
    src = Strategy.parse("pp=2,dp=3")
    blind = plan_live_switch(model, src, tp2, tuple(range(6)), (0, 1, 2, 3))
    aware = plan_live_switch(model, src, tp2, tuple(range(6)), (0, 1, 2, 3), hosts=hosts)
    assert SwitchMeta.of(aware.program).bytes_moved == SwitchMeta.of(blind.program).bytes_moved
    assert _cross_host(aware, hosts) < 0.9 * _cross_host(blind, hosts)
    with pytest.raises(PlanError, match="host map"):
        plan_live_switch(model, src, tp2, tuple(range(6)), (0, 1, 2, 3), hosts=(1, 1, 2))


def test_plan_takes_hosts_of_unequal_sizes(capsys):
    """``parashift plan --cluster ...:hosts=2+2+2``: three hosts of two, and half the moved bytes cross
    them (each new TP pair takes the other pipeline stage's layers from another host)."""
    import json
    from parashift.cli import main
    argv = ["plan", "--model", "tiny-gpt", "--src", "pp=2,dp=3", "--dst", "tp=2,dp=2", "--src-devices", "0-5",
            "--dst-devices", "0-3", "--json", "--cluster"]
    assert main([*argv, "a100-1x2:hosts=2+2+2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["cluster"] == "a100-1x2:hosts=2+2+2"
    assert 0 < got["bytes_inter_node"] < got["bytes_moved"]
    assert main([*argv, "a100-1x8"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_inter_node"] == 0        # one node of 8


def test_a_live_switch_on_gpus_is_priced_with_their_links():
    """``cluster=`` prices the live switch (a job on cuda plans with its GPU kind, not cpu-local): the
    host map is kept, and the links change the lowering. gloo processes move everything point to
    point (no collective by default: see ``lower``); under H100 links ``dp=3,zero=1 ->
    pp=2,dp=2`` sends one piece to several devices as a broadcast, and ``dp=4,zero=1 -> dp=4``, whose
    all_gather gloo takes only when asked, stays point to point (its messages are cheap on NVLink)."""
    from parashift.exec.switch.session import switch_cluster
    model = models.gpt(4, 256, 8, ffn=1024, vocab=1024, seq_len=64, name="h-gpt", dtype="fp32", pad_vocab=64)
    hosts, h100 = (1, 1, 2, 2), switch_cluster("cuda", "NVIDIA H100 80GB HBM3")

    def colls(src, dst, sd, **kw):
        p = plan_live_switch(model, src, dst, sd, (0, 1, 2, 3), hosts=hosts, **kw)
        return p.meta, {k: v for k, v in p.meta.collectives.items() if v}
    cpu, none = colls("dp=3,zero=1", "pp=2,dp=2", (0, 1, 2))
    gpu, bcast = colls("dp=3,zero=1", "pp=2,dp=2", (0, 1, 2), cluster=h100)
    assert cpu.cluster == "cpu-local:hosts=2+2" and gpu.cluster == "h100-1x2:hosts=2+2"
    assert cpu.bytes_inter_node == gpu.bytes_inter_node > 0 and cpu.bytes_moved == gpu.bytes_moved
    assert none == {} and bcast == {"broadcast": 1}
    assert colls("dp=4,zero=1", "dp=4", (0, 1, 2, 3), promote=True)[1] == {"all_gather": 1}
    assert colls("dp=4,zero=1", "dp=4", (0, 1, 2, 3), cluster=h100)[1] == {}
    names = {"NVIDIA H200": "h200", "NVIDIA H800": "h800", "NVIDIA A800-SXM4-80GB": "a800",
             "NVIDIA A100-SXM4-40GB": "a100-40gb", "Tesla V100-SXM2-32GB": "v100", "NVIDIA H100 PCIe": "h100-pcie"}
    assert {n: switch_cluster("cuda", n).gpu.name for n in names} == names
    assert switch_cluster("cpu").name == "cpu-local"
    with pytest.raises(UnknownGPUError, match="--switch-cluster PRESET") as e:   # never priced as another kind
        switch_cluster("cuda", "NVIDIA H800 PCIe")
    assert "\n" not in str(e.value)


def test_switch_cluster_option_is_checked_before_a_job_starts(capsys):
    from parashift.cli import main
    assert main(["run", "--strategy", "dp=2", "--steps", "2", "--switch-cluster", "h100-1x8"]) != 0
    assert "add --live" in capsys.readouterr().err
    assert main(["run", "--strategy", "dp=2", "--steps", "2", "--live", "--switch-cluster", "z900-1x8"]) != 0
    err = capsys.readouterr().err
    assert "z900" in err and len(err.strip().splitlines()) == 1
